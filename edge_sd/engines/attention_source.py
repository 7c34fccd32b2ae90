"""The C source of edge-sd's attention kernel (engines/attention.py says what it computes and why).

It declares no ONNX Runtime header: the few C API functions it calls are taken from the function
table by position (the table only grows at its end), and the custom operator is laid out as version
13 of ONNX Runtime's OrtCustomOp. `attend` is one work item of the thread pool's parallel-for: a tile
of query rows against the blocks of keys and values they attend to.
"""

SOURCE = r"""
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct OrtStatus OrtStatus;
typedef struct {
    void *const *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} ApiBase;

/* Positions in ONNX Runtime's C API table (OrtApi) of the functions used here. */
enum {
    CREATE_DOMAIN = 26, DOMAIN_ADD = 27, ADD_DOMAIN = 28, GET_DATA = 51, GET_DIMS_COUNT = 61,
    GET_DIMS = 62, GET_SHAPE = 65, ATTR_FLOAT = 85, ATTR_INT = 86, GET_INPUT = 90, GET_OUTPUT = 91,
    RELEASE_STATUS = 93, RELEASE_SHAPE = 99, PARALLEL_FOR = 274
};
#define API_VERSION 17

static void *const *api;
typedef OrtStatus *(*create_domain_t)(const char *, void **);
typedef OrtStatus *(*domain_add_t)(void *, const void *);
typedef OrtStatus *(*add_domain_t)(void *, void *);
typedef OrtStatus *(*get_data_t)(const void *, void **);
typedef OrtStatus *(*get_dims_count_t)(const void *, size_t *);
typedef OrtStatus *(*get_dims_t)(const void *, int64_t *, size_t);
typedef OrtStatus *(*get_shape_t)(const void *, void **);
typedef OrtStatus *(*attr_float_t)(const void *, const char *, float *);
typedef OrtStatus *(*attr_int_t)(const void *, const char *, int64_t *);
typedef OrtStatus *(*get_input_t)(const void *, size_t, const void **);
typedef OrtStatus *(*get_output_t)(void *, size_t, const int64_t *, size_t, void **);
typedef void (*release_t)(void *);
typedef OrtStatus *(*parallel_for_t)(const void *, void (*)(void *, size_t), size_t, size_t, void *);
#define FN(t, i) ((t)api[i])

/* The custom operator as ONNX Runtime reads it at version 13 of its layout. */
typedef struct Op {
    uint32_t version;
    void *(*CreateKernel)(const struct Op *, const void *, const void *);
    const char *(*GetName)(const struct Op *);
    const char *(*GetExecutionProviderType)(const struct Op *);
    int (*GetInputType)(const struct Op *, size_t);
    size_t (*GetInputTypeCount)(const struct Op *);
    int (*GetOutputType)(const struct Op *, size_t);
    size_t (*GetOutputTypeCount)(const struct Op *);
    void (*KernelCompute)(void *, void *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const struct Op *, size_t);
    int (*GetOutputCharacteristic)(const struct Op *, size_t);
    int (*GetInputMemoryType)(const struct Op *, size_t);
} Op;

static void release(OrtStatus *s) {
    if (s) FN(release_t, RELEASE_STATUS)(s);
}

typedef struct { int64_t heads, window; float scale; } Kernel;

static void *create(const Op *op, const void *ort, const void *info) {
    (void)op; (void)ort;
    Kernel *k = malloc(sizeof *k);
    if (!k) return NULL;
    k->heads = 1;
    k->window = -1;
    k->scale = 0.0f;
    release(FN(attr_int_t, ATTR_INT)(info, "num_heads", &k->heads));
    release(FN(attr_int_t, ATTR_INT)(info, "local_window_size", &k->window));
    release(FN(attr_float_t, ATTR_FLOAT)(info, "scale", &k->scale));
    return k;
}

typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));
#define L 16   /* floats a vector */
#define B 16   /* keys a block */
#define MAXR 16 /* query rows a tile */
#define MAXG 16
#define MAXD 512

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float x) { return (vf){0} + x; }

static inline vf sel(vi m, vf a, vf b) {
    vi ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* The sum of a vector's lanes, in one fixed tree: lane l and l + 8, then l and l + 4, ... */
static inline float hsum(vf v) {
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return v[0];
}

static inline vf vmax(vf a, vf b) { return sel(a > b, a, b); }

static inline float hmax(vf v) {
    v = vmax(v, __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
    v = vmax(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
    v = vmax(v, __builtin_shuffle(v, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}));
    return v[0];
}

/* The lane sums of 16 vectors as one vector (lane j: a[j]'s sum), each by hsum's tree: at every level
   two vectors' halves are added, lane l to lane l + w, as hsum adds them within one vector. */
static inline vf hsums(vf a[16]) {
    static const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const vi hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const vi lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    static const vi hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    static const vi lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    static const vi hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    static const vi lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    static const vi hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    /* after the four levels, lanes hold keys 0 8 4 12 2 10 6 14 1 9 5 13 3 11 7 15 */
    static const vi order = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    vf x[8], y[4], z[2];
    for (int k = 0; k < 8; k++)
        x[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo1) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi1);
    for (int k = 0; k < 4; k++)
        y[k] = __builtin_shuffle(x[2 * k], x[2 * k + 1], lo2) + __builtin_shuffle(x[2 * k], x[2 * k + 1], hi2);
    for (int k = 0; k < 2; k++)
        z[k] = __builtin_shuffle(y[2 * k], y[2 * k + 1], lo3) + __builtin_shuffle(y[2 * k], y[2 * k + 1], hi3);
    vf r = __builtin_shuffle(z[0], z[1], lo4) + __builtin_shuffle(z[0], z[1], hi4);
    return __builtin_shuffle(r, order);
}

/* e^x for x <= 0 (range reduction by ln 2, a degree-6 polynomial); below -87, 0. */
static inline vf vexp(vf x) {
    vi under = x < splat(-87.0f);
    x = sel(under, splat(-87.0f), x);
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rounded to an integer */
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    vf two_n;
    memcpy(&two_n, &e, sizeof two_n);
    return sel(under, splat(0.0f), p * two_n);
}

static const float zeros[MAXD] __attribute__((aligned(64)));

typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t rows, heads, kv_heads, dim, cap, first, window, tile, tiles, splits;
    float scale;
} Work;

/* One item: a tile of query rows, and the query heads (all, or one of `splits` parts) that share one
   key/value head. Each (row, head) is computed by the same operations whatever else the item holds:
   blocks of B keys at multiples of B, the keys outside the row's range read as zeros and scored
   -infinity, so that they add exact zeros. */
static void attend(void *data, size_t item) {
    const Work *w = data;
    int64_t part = (int64_t)item % w->splits, rest = (int64_t)item / w->splits;
    int64_t h = rest % w->kv_heads, tile = rest / w->kv_heads;
    int64_t G = w->heads / w->kv_heads, g0 = part * (G / w->splits), g1 = g0 + G / w->splits, n = g1 - g0;
    int64_t D = w->dim, r0 = tile * w->tile, r1 = r0 + w->tile < w->rows ? r0 + w->tile : w->rows;
    const float *K = w->k + h * w->cap * D, *V = w->v + h * w->cap * D;
    float *acc = aligned_alloc(64, sizeof(float) * (size_t)((r1 - r0) * n * D)); /* [row][head][D] */
    float *p = aligned_alloc(64, sizeof(float) * (size_t)((r1 - r0) * n * B));  /* [row][head][key] */
    float *m = malloc(sizeof(float) * (size_t)((r1 - r0) * n));
    vf *sum = aligned_alloc(64, sizeof(vf) * (size_t)((r1 - r0) * n));
    if (!acc || !p || !m || !sum) { free(acc); free(p); free(m); free(sum); return; }
    memset(acc, 0, sizeof(float) * (size_t)((r1 - r0) * n * D));
    for (int64_t x = 0; x < (r1 - r0) * n; x++) { m[x] = -INFINITY; sum[x] = splat(0.0f); }
    int64_t lo0 = w->window > 0 ? w->first + r0 - w->window + 1 : 0, last = w->first + r1 - 1;
    for (int64_t b0 = (lo0 > 0 ? lo0 : 0) / B * B; b0 <= last; b0 += B) {
        for (int64_t i = 0; i < r1 - r0; i++) {
            int64_t t = w->first + r0 + i, lo = w->window > 0 && t - w->window + 1 > 0 ? t - w->window + 1 : 0;
            if (b0 + B <= lo || b0 > t) continue; /* none of the block for this row */
            const float *rows[B];
            vi out;
            for (int j = 0; j < B; j++) {
                int in = b0 + j >= lo && b0 + j <= t;
                out[j] = in ? 0 : -1;
                rows[j] = in ? K + (b0 + j) * D : zeros;
            }
            for (int64_t g = 0; g < n; g++) {
                const float *q = w->q + (r0 + i) * w->heads * D + (h * G + g0 + g) * D;
                vf a[B];
                vf qc = load(q);
                for (int j = 0; j < B; j++) a[j] = qc * load(rows[j]);
                for (int64_t c = L; c < D; c += L) {
                    qc = load(q + c);
                    for (int j = 0; j < B; j++) a[j] += qc * load(rows[j] + c);
                }
                vf sv = sel(out, splat(-INFINITY), hsums(a) * w->scale);
                int64_t x = i * n + g;
                float top = hmax(sv);
                if (top > m[x]) {
                    float f = m[x] == -INFINITY ? 0.0f : expf(m[x] - top);
                    sum[x] *= f;
                    for (int64_t c = 0; c < D; c += L) store(acc + x * D + c, load(acc + x * D + c) * f);
                    m[x] = top;
                }
                vf e = sel(out, splat(0.0f), vexp(sv - m[x]));
                sum[x] += e;
                store(p + x * B, e);
            }
            for (int j = 0; j < B; j++) rows[j] = out[j] ? zeros : V + (b0 + j) * D;
            /* Values: two heads and four vectors of D at a time, each lane summed over the block's
               keys in order. */
            for (int64_t g = 0; g < n; g += 2) {
                int two = g + 1 < n;
                float *x0 = acc + (i * n + g) * D, *x1 = two ? x0 + D : x0;
                const float *p0 = p + (i * n + g) * B, *p1 = two ? p0 + B : p0;
                for (int64_t c = 0; c < D; c += 4 * L) {
                    vf a0[4], a1[4];
                    for (int u = 0; u < 4; u++) {
                        a0[u] = load(x0 + c + u * L);
                        a1[u] = load(x1 + c + u * L);
                    }
                    for (int j = 0; j < B; j++) {
                        vf e0 = splat(p0[j]), e1 = splat(p1[j]);
                        for (int u = 0; u < 4; u++) {
                            vf v = load(rows[j] + c + u * L);
                            a0[u] += e0 * v;
                            a1[u] += e1 * v;
                        }
                    }
                    for (int u = 0; u < 4; u++) {
                        store(x0 + c + u * L, a0[u]);
                        if (two) store(x1 + c + u * L, a1[u]);
                    }
                }
            }
        }
    }
    for (int64_t i = 0; i < r1 - r0; i++)
        for (int64_t g = 0; g < n; g++) {
            float inv = 1.0f / hsum(sum[i * n + g]);
            float *o = w->out + (r0 + i) * w->heads * D + (h * G + g0 + g) * D;
            for (int64_t c = 0; c < D; c += L) store(o + c, load(acc + (i * n + g) * D + c) * inv);
        }
    free(acc); free(p); free(m); free(sum);
}

static void *tensor(const void *value, int64_t *dims, size_t *n) {
    void *info, *data;
    release(FN(get_shape_t, GET_SHAPE)(value, &info));
    release(FN(get_dims_count_t, GET_DIMS_COUNT)(info, n));
    if (*n > 8) *n = 8;
    release(FN(get_dims_t, GET_DIMS)(info, dims, *n));
    FN(release_t, RELEASE_SHAPE)(info);
    release(FN(get_data_t, GET_DATA)(value, &data));
    return data;
}

static void *input(void *ctx, size_t i, int64_t *dims, size_t *n) {
    const void *value;
    release(FN(get_input_t, GET_INPUT)(ctx, i, &value));
    return tensor(value, dims, n);
}

static void *output(void *ctx, size_t i, const int64_t *dims, size_t n) {
    void *value;
    int64_t ignored[8];
    size_t m;
    release(FN(get_output_t, GET_OUTPUT)(ctx, i, dims, n, &value));
    return tensor(value, ignored, &m);
}

/* Inputs: query [1, s, heads x D], key and value [1, s, kv_heads x D], past key and value
   [1, kv_heads, capacity, D], seqlens_k [1] (positions in the buffer after this forward, less one),
   total_sequence_length. Outputs: attention [1, s, heads x D], present key and value (the past's
   buffer, where they are bound to it, as edge-sd binds them; else a copy). */
static void compute(void *kernel, void *ctx) {
    const Kernel *k = kernel;
    int64_t qd[8], kd[8], pd[8], sd[8], unused[8];
    size_t nq, nk, np, ns, nu;
    const float *q = input(ctx, 0, qd, &nq), *kin = input(ctx, 1, kd, &nk), *vin = input(ctx, 2, unused, &nu);
    const float *pk = input(ctx, 3, pd, &np), *pv = input(ctx, 4, unused, &nu);
    const int32_t *seqlens = input(ctx, 5, sd, &ns);
    int64_t rows = qd[1], kvh = pd[1], cap = pd[2], D = pd[3];
    int64_t first = (int64_t)seqlens[0] + 1 - rows;
    float *out = output(ctx, 0, qd, nq), *ok = output(ctx, 1, pd, np), *ov = output(ctx, 2, pd, np);
    size_t bytes = (size_t)(kvh * cap * D) * sizeof(float);
    if (ok != pk) memcpy(ok, pk, bytes);
    if (ov != pv) memcpy(ov, pv, bytes);
    for (int64_t h = 0; h < kvh; h++)
        for (int64_t r = 0; r < rows; r++) {
            memcpy(ok + (h * cap + first + r) * D, kin + (r * kvh + h) * D, D * sizeof(float));
            memcpy(ov + (h * cap + first + r) * D, vin + (r * kvh + h) * D, D * sizeof(float));
        }
    /* Tiles of up to MAXR rows (more rows share each block of keys read), at least two while there
       are two rows; one row alone has its heads split in two. Either way, two items or more. */
    int64_t tile = (rows + 1) / 2 < MAXR ? (rows + 1) / 2 : MAXR, tiles = (rows + tile - 1) / tile;
    int64_t G = k->heads / kvh;
    Work w = {q, ok, ov, out, rows, k->heads, kvh, D, cap, first, k->window, tile, tiles,
              tiles * kvh == 1 && G % 2 == 0 ? 2 : 1, k->scale != 0.0f ? k->scale : 1.0f / sqrtf((float)D)};
    release(FN(parallel_for_t, PARALLEL_FOR)(ctx, attend, (size_t)(tiles * kvh * w.splits), 0, &w));
}

static const char *name(const Op *op) { (void)op; return "CachedAttention"; }
static const char *provider(const Op *op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const Op *op, size_t i) { (void)op; return i >= 5 ? 6 : 1; } /* int32 : float */
static size_t inputs(const Op *op) { (void)op; return 7; }
static int output_type(const Op *op, size_t i) { (void)op; (void)i; return 1; }
static size_t outputs(const Op *op) { (void)op; return 3; }
static void destroy(void *k) { free(k); }
static int required(const Op *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const Op *op, size_t i) { (void)op; (void)i; return 0; }

static Op op = {13, create, name, provider, input_type, inputs, output_type, outputs, compute, destroy,
                required, required, default_memory};

OrtStatus *RegisterCustomOps(void *options, const ApiBase *base) {
    api = base->GetApi(API_VERSION);
    void *domain;
    OrtStatus *s = FN(create_domain_t, CREATE_DOMAIN)("edge_sd", &domain);
    if (s) return s;
    if ((s = FN(domain_add_t, DOMAIN_ADD)(domain, &op))) return s;
    return FN(add_domain_t, ADD_DOMAIN)(options, domain);
}
"""
