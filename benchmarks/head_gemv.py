"""Does a hand-written kernel read the LM head faster than ONNX Runtime's? Two C kernels for the
product over 8-bit blocks of 32 against MatMulNBits, for the row counts decoding uses.

    .venv/bin/python benchmarks/head_gemv.py [--rounds 3] [--rows 1,2,4,8,17]

head_kernel.py found MatMulNBits reading the default target's 8-bit head (262,144 x 640) below the
rate the memory streams. Two kernels (built by the system's `cc`, -O3 -march=native; AVX-512 VNNI
needed) quantize each row of activations to int8 per block of 32, as MatMulNBits does at accuracy
level 4, take each block's dot product in integers, and sum the blocks in float32:

- rows (compiled here): over the blocks as the export stores them (one byte a weight, shifted by
  128, a float32 scale a block), four weight rows' blocks prefetched ahead, two activation rows a
  pass;
- repacked: the runtime's own (edge_sd/engines/lm_head.py), over blocks repacked eight weight rows
  at a time (four values of eight rows an instruction), as ONNX Runtime repacks its own, four such
  groups side by side, up to three activation rows a pass.

Each computes a row's logits by the same instructions whatever the row count, as verification
needs. Both are checked against a float64 product of the same int8 activations, then timed with
MatMulNBits on 2 threads, one run of each in turn per row count (1: a decoding step; more: a
verification forward), random weights. Writes benchmarks/results/head_gemv.{md,json,png}.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from edge_sd.bench.run import machine, write_results
from edge_sd.engines.lm_head import LmHead

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_kernel import BLOCK, HIDDEN, VOCAB, head_session  # noqa: E402

PREFETCH_ROWS = 4

SOURCE = r"""#include <math.h>
#include <stdint.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define EDGE_SD_VNNI 1
#else
#define EDGE_SD_VNNI 0
#endif

int edge_sd_vnni(void) { return EDGE_SD_VNNI; }

/* x [m, k] -> xq [m, k] int8, dx [m, k/32] (one scale a block), negc [m, k/32, 8]: -128 times the sum
   of each group of four values, the start from which a dot product of the stored bytes (weight + 128)
   gives that of the weights. */
void edge_sd_quantize(const float *x, long m, long k, int8_t *xq, float *dx, int32_t *negc) {
    long kb = k / 32;
    for (long r = 0; r < m; r++) {
        for (long b = 0; b < kb; b++) {
            const float *v = x + r * k + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = xq + r * k + b * 32;
            for (int i = 0; i < 32; i++) {
                float t = nearbyintf(v[i] * inv);
                q[i] = (int8_t)(t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t));
            }
            for (int j = 0; j < 8; j++)
                negc[(r * kb + b) * 8 + j] = -128 * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
            dx[r * kb + b] = d;
        }
    }
}

#if EDGE_SD_VNNI
/* one block's dot product for activation row x, into acc: integers first (the stored bytes times the
   int8 values, started from negc), then times the block's two scales */
#define EDGE_SD_BLOCK(acc, wv, xq, dx, negc, b) { \
        __m256i d = _mm256_dpbusd_epi32(_mm256_loadu_si256((const __m256i *)((negc) + (b) * 8)), wv, \
                                        _mm256_loadu_si256((const __m256i *)((xq) + (b) * 32))); \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(s[b] * (dx)[b]), acc); }

static inline float hsum(__m256 a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#endif

/* the dot products of one weight row with activation rows r and r + 1 (two == 0: row r alone), each
   summed by the same instructions either way: four accumulators a row (block b % 4), so that no block
   waits on the one before it */
static inline void dot_rows(const uint8_t *w, const float *s, long kb, const int8_t *xq, const float *dx,
                            const int32_t *negc, int two, float *y0, float *y1) {
#if EDGE_SD_VNNI
    const int8_t *xq1 = xq + kb * 32;
    const float *dx1 = dx + kb;
    const int32_t *negc1 = negc + kb * 8;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    long b = 0;
#define EDGE_SD_BOTH(acc, acc1, j) { \
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (b + j) * 32)); \
        EDGE_SD_BLOCK(acc, wv, xq, dx, negc, b + j) \
        if (two) EDGE_SD_BLOCK(acc1, wv, xq1, dx1, negc1, b + j) }
    for (; b + 4 <= kb; b += 4) {
        EDGE_SD_BOTH(a0, c0, 0) EDGE_SD_BOTH(a1, c1, 1) EDGE_SD_BOTH(a2, c2, 2) EDGE_SD_BOTH(a3, c3, 3)
    }
    for (; b < kb; b++) EDGE_SD_BOTH(a0, c0, 0)
    *y0 = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    if (two) *y1 = hsum(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
#else
    for (int r = 0; r <= two; r++) {
        float acc = 0.0f;
        for (long b = 0; b < kb; b++) {
            int32_t t = 0;
            for (int i = 0; i < 32; i++) t += (int32_t)w[b * 32 + i] * xq[r * kb * 32 + b * 32 + i];
            for (int j = 0; j < 8; j++) t += negc[r * kb * 8 + b * 8 + j];
            acc += (float)t * (s[b] * dx[r * kb + b]);
        }
        *(r ? y1 : y0) = acc;
    }
#endif
}

/* y[r * ldy + n] for rows n0 <= n < n1 of the weights and all m rows of x (quantized above) */
void edge_sd_rows(const uint8_t *w, const float *s, long kb, const int8_t *xq, const float *dx,
                  const int32_t *negc, long m, float *y, long ldy, long n0, long n1, long prefetch) {
    for (long n = n0; n < n1; n++) {
        const uint8_t *wr = w + n * kb * 32;
        const float *sr = s + n * kb;
        if (n + prefetch < n1) {
            for (long o = 0; o < kb * 32; o += 64) __builtin_prefetch(wr + prefetch * kb * 32 + o);
            for (long o = 0; o < kb; o += 16) __builtin_prefetch(sr + prefetch * kb + o);
        }
        for (long r = 0; r < m; r += 2) {
            int two = r + 1 < m;
            dot_rows(wr, sr, kb, xq + r * kb * 32, dx + r * kb, negc + r * kb * 8, two,
                     y + r * ldy + n, y + (r + 1) * ldy + n);
        }
    }
}
"""


def build(folder: Path) -> ctypes.CDLL:
    src, lib = folder / "head_gemv.c", folder / "libhead_gemv.so"
    src.write_text(SOURCE)
    subprocess.run(["cc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(lib), str(src), "-lm"], check=True)
    dll = ctypes.CDLL(str(lib))
    p, i = ctypes.c_void_p, ctypes.c_long
    dll.edge_sd_quantize.argtypes = [p, i, i, p, p, p]
    dll.edge_sd_rows.argtypes = [p, p, i, p, p, p, i, p, i, i, i, i]
    dll.edge_sd_vnni.restype = ctypes.c_int
    return dll


class Kernels:
    """Both kernels over one random head, each split over two threads (ctypes lets go of the GIL)."""

    def __init__(self, dll: ctypes.CDLL, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.dll, self.kb = dll, HIDDEN // BLOCK
        self.w = rng.integers(0, 256, (VOCAB, HIDDEN), dtype=np.uint8)
        # scales that halves hold, as a GGUF file's Q8_0 blocks carry them
        self.s = rng.uniform(1e-3, 1e-2, (VOCAB, self.kb)).astype(np.float16).astype(np.float32)
        self.head = LmHead.of(self.w, self.s, threads=2)  # the runtime's own kernel
        self.pool = ThreadPoolExecutor(1)

    def quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = x.shape[0]
        xq, dx = np.empty((m, HIDDEN), np.int8), np.empty((m, self.kb), np.float32)
        negc = np.empty((m, self.kb, 8), np.int32)
        self.dll.edge_sd_quantize(x.ctypes.data, m, HIDDEN, xq.ctypes.data, dx.ctypes.data, negc.ctypes.data)
        return xq, dx, negc

    def _halves(self, fn, args: tuple, n: int, *extra) -> None:
        waits = self.pool.submit(fn, *args, n // 2, n, *extra)
        fn(*args, 0, n // 2, *extra)
        waits.result()

    def rows(self, x: np.ndarray, y: np.ndarray) -> None:
        xq, dx, negc = self.quantize(x)
        args = (self.w.ctypes.data, self.s.ctypes.data, self.kb, xq.ctypes.data, dx.ctypes.data, negc.ctypes.data,
                len(x), y.ctypes.data, VOCAB)
        self._halves(self.dll.edge_sd_rows, args, VOCAB, PREFETCH_ROWS)

    def repacked(self, x: np.ndarray, y: np.ndarray) -> None:
        self.head(x, y)

    def reference(self, x: np.ndarray) -> np.ndarray:
        xq, dx, _ = self.quantize(x)
        w = self.w.reshape(VOCAB, self.kb, BLOCK).astype(np.float64) - 128
        dots = np.einsum("nbi,rbi->rnb", w, xq.reshape(len(x), self.kb, BLOCK).astype(np.float64))
        return (dots * self.s[None] * dx[:, None]).sum(-1)


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# A hand-written kernel for the LM head's product, against ONNX Runtime's", "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}. Command: "
        f"`.venv/bin/python benchmarks/head_gemv.py --rounds {result['rounds']}`. The default target's head "
        f"({VOCAB:,} x {HIDDEN}, 8-bit blocks of {BLOCK}, int8 activations), random weights, 2 threads each; "
        "one run of each in turn, median ms over all runs. Largest difference from a float64 product of the "
        f"same int8 activations: rows {result['max_diff']['rows']:.1e}, repacked "
        f"{result['max_diff']['repacked']:.1e} (logits up to {result['max_diff']['scale']:.0f}).", "",
        "| activation rows | MatMulNBits, ms | rows kernel, ms | repacked kernel, ms | rows / MatMulNBits | "
        "repacked / MatMulNBits |", "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(f"| {r['m']} | {r['ort']:.2f} | {r['rows']:.2f} | {r['repacked']:.2f} | "
                     f"{r['rows'] / r['ort']:.2f}x | {r['repacked'] / r['ort']:.2f}x |")
    one = result["rows"][0]
    best = min(("rows", "repacked"), key=lambda n: max(r[n] / r["ort"] for r in result["rows"]))
    worst = max(r[best] / r["ort"] for r in result["rows"])
    lines += ["", f"At {one['m']} row the rows kernel takes {one['rows'] / one['ort']:.2f}x MatMulNBits' time and the "
              f"repacked one {one['repacked'] / one['ort']:.2f}x. A verification forward's logits must be those of "
              "single steps, so one kernel computes every row count; over all the counts measured the better of "
              f"the two ({best}) is at most {worst:.2f}x MatMulNBits' time. edge-sd computes its target's head "
              "with the repacked kernel (edge_sd/engines/lm_head.py).", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    ms = [r["m"] for r in result["rows"]]
    for key, label in (("ort", "MatMulNBits"), ("rows", "rows kernel"), ("repacked", "repacked kernel")):
        ax.plot(ms, [r[key] for r in result["rows"]], marker="o", label=label)
    ax.set_xlabel("activation rows")
    ax.set_ylabel("ms")
    ax.set_title("LM head product, 262,144 x 640, 8-bit, 2 threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=20, help="runs of each per round and row count")
    ap.add_argument("--rows", default="1,2,4,8,17")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "head_gemv", report, plot))
        return
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        if not dll.edge_sd_vnni():
            sys.exit("head_gemv: this CPU (or compiler) has no AVX-512 VNNI, which the kernels are written for")
        k = Kernels(dll)
        x = np.random.default_rng(1).standard_normal((3, HIDDEN)).astype(np.float32)
        ref = k.reference(x)
        diffs = {"scale": float(np.abs(ref).max())}
        for name in ("rows", "repacked"):
            y = np.empty((3, VOCAB), np.float32)
            getattr(k, name)(x, y)
            diffs[name] = float(np.abs(y - ref).max())
            if diffs[name] > 1e-5 * diffs["scale"]:
                sys.exit(f"head_gemv: the {name} kernel is wrong (largest difference {diffs[name]:.2e})")
        session = head_session(8, 2, spin="run")  # its threads stop as a run returns, as the kernels' do
        counts = [int(v) for v in args.rows.split(",")]
        times: dict[tuple[int, str], list[float]] = {(m, n): [] for m in counts for n in ("ort", "rows", "repacked")}
        rng = np.random.default_rng(2)
        for rnd in range(args.rounds):
            for m in counts:
                x = rng.standard_normal((m, HIDDEN)).astype(np.float32)
                y = np.empty((m, VOCAB), np.float32)
                run = {"ort": lambda x=x: session.run(None, {"x": x}), "rows": lambda x=x, y=y: k.rows(x, y),
                       "repacked": lambda x=x, y=y: k.repacked(x, y)}
                for f in run.values():
                    f()
                for _ in range(args.runs):
                    for name, f in run.items():
                        start = time.perf_counter()
                        f()
                        times[(m, name)].append(1e3 * (time.perf_counter() - start))
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{m} rows {statistics.median(times[(m, 'ort')]):.2f} / {statistics.median(times[(m, 'rows')]):.2f} / "
                f"{statistics.median(times[(m, 'repacked')]):.2f} ms" for m in counts), flush=True)
    rows = [{"m": m, **{n: statistics.median(times[(m, n)]) for n in ("ort", "rows", "repacked")}} for m in counts]
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "rounds": args.rounds,
              "runs": args.runs, "max_diff": diffs, "rows": rows}
    print(write_results(args.out, "head_gemv", report, plot, result))


if __name__ == "__main__":
    main()
