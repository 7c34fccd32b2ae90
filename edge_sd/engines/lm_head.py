"""The LM head's product computed outside ONNX Runtime, over the export's own 8-bit blocks.

A target's head is most of a decoding step: Gemma-3-270M's is 262,144 x 640 weights, read whole for
every token, so a step's time is mostly the bytes the head's kernel streams. ONNX Runtime's
MatMulNBits streams a repacked copy with float32 scales and block sums, 40 bytes a block of 32
weights; the C kernel here reads 34, as the GGUF file holds them (the bytes and a float16 scale,
exactly the file's). It was measured about as fast as MatMulNBits for one row and faster for the
several rows of a verification forward (benchmarks/head_gemv.py).

The blocks are repacked at load eight rows at a time (four values of eight rows in one VNNI
instruction, as MatMulNBits repacks its own), four such groups side by side: a tile of four groups
and up to three rows of activations reads its weights once for all three rows. Each row of
activations is quantized to int8 per block of 32 (as MatMulNBits does at accuracy level 4), each
block's dot product is exact in integers, and the blocks are summed in float32 in one fixed order,
by the same operations in the VNNI and the portable path. A logit is thus computed alike whatever
else is computed beside it (how many rows, which tile or thread), so a verification forward's
logits are those of single steps, as speculative decoding needs (tests/test_lm_head.py).

The kernel is compiled on first use by the system's C compiler ($CC, or cc) for this CPU, and kept
in the cache folder ($EDGE_SD_CACHE, by default ~/.cache/edge-sd). It is used where the CPU has
AVX-512 VNNI with 256-bit forms (where it was measured); elsewhere, or without a compiler, the
graph's own head runs as before. EDGE_SD_LM_HEAD=0 turns it off; =1 uses it on any CPU (a portable
C loop, for tests).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from edge_sd.engines import native
from edge_sd.errors import ArtifactError

BLOCK = 32
GROUP = 8  # weight rows repacked together
ENV = "EDGE_SD_LM_HEAD"

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(EDGE_SD_PORTABLE)
#include <immintrin.h>
#define VNNI 1
#else
#define VNNI 0
#endif

int edge_sd_vnni(void) { return VNNI; }

/* an IEEE half's value */
static inline float half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {
        float v = ldexpf((float)m, -24); /* zero or subnormal */
        return sign ? -v : v;
    }
    bits = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Where group g's (8 weight rows') block b starts. The blocks of four groups share 1024 bytes, block
   after block, so that a tile of four groups reads one stream. In them, group g's j-th 32 bytes (four
   values of each of its eight rows) lie at j * 128 + (g & 3) * 32: the four groups' j-th loads are
   adjacent (256 bytes apart, they met in the same cache banks and ran slower). */
static inline long at(long g, long b, long kb) { return ((g >> 2) * kb + b) * 1024 + (g & 3) * 32; }

/* w [n][kb][32] bytes and s [n][kb] halves, the head's rows from first * 8 on -> wp (laid out as `at`
   says) and sp [rows/8][kb][8 rows], for the row groups first + g0 <= g < first + g1 */
void edge_sd_repack(const uint8_t *w, const uint16_t *s, long kb, uint8_t *wp, uint16_t *sp, long first,
                    long g0, long g1) {
    for (long g = g0; g < g1; g++)
        for (long b = 0; b < kb; b++)
            for (int n = 0; n < 8; n++) {
                const uint8_t *src = w + ((g * 8 + n) * kb + b) * 32;
                uint8_t *dst = wp + at(first + g, b, kb) + n * 4;
                for (int j = 0; j < 8; j++) memcpy(dst + j * 128, src + j * 4, 4);
                sp[((first + g) * kb + b) * 8 + n] = s[(g * 8 + n) * kb + b];
            }
}

/* x [m][k] -> xq [m][k] int8 and dx [m][kb], one scale a block of 32 (largest magnitude over 127,
   rounded to nearest), and nsum [m][kb]: -128 times each block's sum, from which a dot product of
   the stored bytes (weight + 128) gives that of the weights */
void edge_sd_quantize(const float *x, long m, long k, int8_t *xq, float *dx, int32_t *nsum) {
    long kb = k / 32;
    for (long r = 0; r < m; r++)
        for (long b = 0; b < kb; b++) {
            const float *v = x + r * k + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = xq + r * k + b * 32;
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                float t = nearbyintf(v[i] * inv);
                q[i] = (int8_t)(t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t));
                sum += q[i];
            }
            dx[r * kb + b] = amax / 127.0f;
            nsum[r * kb + b] = -128 * sum;
        }
}

#if VNNI
/* Weight groups g.. g + NG (NG 1 or 4) against activation rows r.. r + NR (NR <= 3), over all blocks.
   For each group and row the float operations are those of that pair alone, in block order (integer
   sums are exact in any order), so a logit does not depend on the tile it was computed in. A tile
   lets one load of weights serve NR rows and keeps NG x NR chains of VNNI instructions in flight (one
   row: two a group). `ahead`, where not null, is fetched into the second-level cache block by block:
   the next four groups' weights, read from memory while these are computed. */
static inline __attribute__((always_inline)) void tile(const uint8_t *wp, const uint16_t *sp, long kb,
        const int8_t *xq, const float *dx, const int32_t *nsum, float *y, long ldy, long g, long r,
        const uint8_t *ahead, const int NG, const int NR) {
    __m256 f[4][3];
    for (int a = 0; a < NG; a++)
        for (int c = 0; c < NR; c++) f[a][c] = _mm256_setzero_ps();
    for (long b = 0; b < kb; b++) {
        const uint8_t *wb = wp + at(g, b, kb);
        if (ahead)
            for (int i = 0; i < 1024; i += 64) _mm_prefetch((const char *)(ahead + b * 1024 + i), _MM_HINT_T1);
        __m256i acc[4][3], odd[4];
        for (int c = 0; c < NR; c++) {
            __m256i start = _mm256_set1_epi32(nsum[(r + c) * kb + b]);
            for (int a = 0; a < NG; a++) acc[a][c] = start;
        }
        for (int a = 0; a < NG; a++) odd[a] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            __m256i w[4];
            for (int a = 0; a < NG; a++) w[a] = _mm256_loadu_si256((const __m256i *)(wb + a * 32 + 128 * j));
            for (int c = 0; c < NR; c++) {
                __m256i x = _mm256_set1_epi32(((const int32_t *)(xq + (r + c) * kb * 32))[b * 8 + j]);
                for (int a = 0; a < NG; a++) {
                    if (NR == 1 && (j & 1)) odd[a] = _mm256_dpbusd_epi32(odd[a], w[a], x);
                    else acc[a][c] = _mm256_dpbusd_epi32(acc[a][c], w[a], x);
                }
            }
        }
        for (int a = 0; a < NG; a++) {
            __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + ((g + a) * kb + b) * 8)));
            for (int c = 0; c < NR; c++) {
                __m256i t = NR == 1 ? _mm256_add_epi32(acc[a][c], odd[a]) : acc[a][c];
                __m256 scale = _mm256_mul_ps(sc, _mm256_set1_ps(dx[(r + c) * kb + b]));
                f[a][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), scale, f[a][c]);
            }
        }
    }
    for (int a = 0; a < NG; a++)
        for (int c = 0; c < NR; c++)
            _mm256_storeu_ps(y + (r + c) * ldy + (g + a) * 8, f[a][c]);
}
#endif

/* y[r * ldy + n] for the weight rows of groups g0 <= g < g1 and all m rows of activations. Per row
   and block: the integer dot product, times the weight's and the activation's scales, added to the
   row's sum in block order (one fused multiply-add a block, in both paths alike). */
void edge_sd_rows(const uint8_t *wp, const uint16_t *sp, long kb, const int8_t *xq, const float *dx,
                  const int32_t *nsum, long m, float *y, long ldy, long g0, long g1) {
#if VNNI
    for (long g = g0; g < g1;) {
        int ng = (g & 3) == 0 && g + 4 <= g1 ? 4 : 1;
        /* Where these groups take several passes (more than three rows), the first fetches the next
           four groups' weights; in a single pass the hardware's own prefetching was faster. */
        const uint8_t *ahead = m > 3 && ng == 4 && g + 8 <= g1 ? wp + at(g + 4, 0, kb) : 0;
        for (long r = 0; r < m;) {
            long nr = m - r >= 3 ? 3 : m - r;
            const uint8_t *pre = r ? 0 : ahead;
            if (ng == 4) {
                if (nr == 3) tile(wp, sp, kb, xq, dx, nsum, y, ldy, g, r, pre, 4, 3);
                else if (nr == 2) tile(wp, sp, kb, xq, dx, nsum, y, ldy, g, r, pre, 4, 2);
                else tile(wp, sp, kb, xq, dx, nsum, y, ldy, g, r, pre, 4, 1);
            } else {
                if (nr == 3) tile(wp, sp, kb, xq, dx, nsum, y, ldy, g, r, 0, 1, 3);
                else if (nr == 2) tile(wp, sp, kb, xq, dx, nsum, y, ldy, g, r, 0, 1, 2);
                else tile(wp, sp, kb, xq, dx, nsum, y, ldy, g, r, 0, 1, 1);
            }
            r += nr;
        }
        g += ng;
    }
#else
    for (long g = g0; g < g1; g++) {
        const uint16_t *sg = sp + g * kb * 8;
        for (long r = 0; r < m; r++) {
            const int32_t *xr = (const int32_t *)(xq + r * kb * 32);
            float acc[8] = {0};
            for (long b = 0; b < kb; b++) {
                const uint8_t *wb = wp + at(g, b, kb);
                const int8_t *xb = (const int8_t *)(xr + b * 8);
                float f = dx[r * kb + b];
                for (int n = 0; n < 8; n++) {
                    int32_t t = nsum[r * kb + b];
                    for (int j = 0; j < 8; j++)
                        for (int i = 0; i < 4; i++) t += (int32_t)wb[j * 128 + n * 4 + i] * xb[j * 4 + i];
                    acc[n] = fmaf((float)t, half(sg[b * 8 + n]) * f, acc[n]);
                }
            }
            for (int n = 0; n < 8; n++) y[r * ldy + g * 8 + n] = acc[n];
        }
    }
#endif
}
"""

_lock = threading.Lock()
_built: dict[bool, tuple[Any, str]] = {}  # portable or not: the loaded kernel or None, and why there is none


def library(portable: bool = False) -> tuple[Any, str]:
    """The compiled kernel (ctypes) and "", or None and why there is none. Built once per machine and
    compiler, then loaded from the cache folder. portable: the plain C loop even where the CPU has
    AVX-512 VNNI (tests)."""
    with _lock:
        if portable not in _built:
            try:
                _built[portable] = _build(portable), ""
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:
                _built[portable] = None, str(e)
        return _built[portable]


def _build(portable: bool) -> Any:
    path = native.compiled(SOURCE, "edge_sd_lm_head", "the LM head's kernel", ("EDGE_SD_PORTABLE",) if portable else ())
    lib = ctypes.CDLL(str(path))
    p, i = ctypes.c_void_p, ctypes.c_long
    lib.edge_sd_repack.argtypes = [p, p, i, p, p, i, i, i]
    lib.edge_sd_quantize.argtypes = [p, i, i, p, p, p]
    lib.edge_sd_rows.argtypes = [p, p, i, p, p, p, i, p, i, i, i]
    for fn in (lib.edge_sd_repack, lib.edge_sd_quantize, lib.edge_sd_rows):
        fn.restype = None
    lib.edge_sd_vnni.restype = ctypes.c_int
    return lib


def wanted() -> tuple[bool, str]:
    """Whether engines compute their LM head here, and why not: EDGE_SD_LM_HEAD=0 never, =1 on any
    CPU, unset where the kernel was built with AVX-512 VNNI."""
    choice = os.environ.get(ENV, "").strip()
    if choice == "0":
        return False, f"{ENV}=0"
    lib, why = library()
    if lib is None:
        return False, why
    if choice != "1" and not lib.edge_sd_vnni():
        return False, "this CPU has no AVX-512 VNNI"
    return True, ""


class LmHead:
    """logits = hidden @ W^T for W in 8-bit blocks of 32: bytes [rows, cols] (each weight + 128) and
    scales [rows, cols / 32] (float32 values a float16 holds exactly), given in runs of rows (`load`,
    or `of` for whole arrays) and computed by `threads` threads over ranges of rows (portable: by the
    plain C loop, whatever the CPU)."""

    def __init__(self, rows: int, cols: int, threads: int = 1, portable: bool = False):
        lib, why = library(portable)
        if lib is None:
            raise RuntimeError(why)
        if cols % BLOCK or rows % GROUP or rows <= 0 or cols <= 0:
            raise ValueError(f"a head of {rows} x {cols} is not blocks of {BLOCK} in rows of a multiple of {GROUP}")
        self._lib = lib
        self.rows, self.cols, self._kb = rows, cols, cols // BLOCK
        groups = rows // GROUP
        self.threads = max(1, min(threads, groups))
        self._ranges = self._cut(0, groups)
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None
        # four groups' blocks side by side (the kernel's `at`): room for whole fours of groups
        self._packed = np.empty(-(-groups // 4) * 4 * GROUP * cols, dtype=np.uint8)
        self._scales = np.empty(rows * self._kb, dtype=np.float16)

    @classmethod
    def of(cls, weight: np.ndarray, scales: np.ndarray, threads: int = 1, portable: bool = False) -> LmHead:
        """The head of whole arrays: weight [rows, cols] uint8, scales [rows, cols / 32] float32."""
        rows, cols = weight.shape
        head = cls(rows, cols, threads=threads, portable=portable)
        head.load(weight, scales, 0)
        return head

    def load(self, weight: np.ndarray, scales: np.ndarray, first: int) -> None:
        """Repack rows first.. (a multiple of 8 of them) from their bytes and scales. The scales are
        kept as halves, which a GGUF file's blocks carry (34 bytes a block of 32 then, not 36); a
        scale a half cannot hold is refused."""
        n = len(weight)
        if (weight.shape != (n, self.cols) or scales.shape != (n, self._kb) or n % GROUP or first % GROUP
                or first + n > self.rows):
            raise ValueError(f"weights {weight.shape} and scales {scales.shape} at row {first} are not blocks of "
                             f"{BLOCK} of this head's rows in runs of a multiple of {GROUP}")
        if weight.dtype != np.uint8 or scales.dtype != np.float32:
            raise ValueError("the LM head's kernel takes uint8 weights and float32 scales")
        halves = scales.astype(np.float16)
        if not np.array_equal(halves.astype(np.float32), scales):
            raise ValueError("the LM head's kernel takes scales that are halves (float16) exactly")
        weight = np.ascontiguousarray(weight)
        self._parallel(self._lib.edge_sd_repack, (weight.ctypes.data, halves.ctypes.data, self._kb,
                                                  self._packed.ctypes.data, self._scales.ctypes.data,
                                                  first // GROUP), self._cut(0, n // GROUP))

    def _cut(self, g0: int, g1: int) -> list[tuple[int, int]]:
        # inner cuts at whole fours of groups, the kernel's widest tile
        cuts = [g0, *(min(g1, max(g0, round(c / 4) * 4)) for c in np.linspace(g0, g1, self.threads + 1)[1:-1]), g1]
        return list(zip(cuts[:-1], cuts[1:], strict=True))

    def _parallel(self, fn: Any, args: tuple[Any, ...], ranges: list[tuple[int, int]] | None = None) -> None:
        """fn(*args, g0, g1) over ranges of row groups (by default all of them), a range a thread
        (ctypes lets go of the GIL)."""
        ranges = ranges or self._ranges
        pool = self._pool
        waits = [pool.submit(fn, *(*args, lo, hi)) for lo, hi in ranges[1:]] if pool is not None else []
        lo, hi = ranges[0]
        fn(*args, lo, hi)
        for w in waits:
            w.result()

    def __call__(self, hidden: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Logits [n, rows] of hidden [n, cols], into out (float32, rows contiguous) where given."""
        x = np.ascontiguousarray(hidden, dtype=np.float32).reshape(-1, self.cols)
        m, kb = x.shape[0], self._kb
        if out is None:
            out = np.empty((m, self.rows), dtype=np.float32)
        if out.shape != (m, self.rows) or out.dtype != np.float32 or out.strides[1] != 4:
            raise ValueError(f"the logits of {m} rows go in a float32 array [{m}, {self.rows}]")
        xq = np.empty((m, self.cols), dtype=np.int8)
        dx = np.empty((m, kb), dtype=np.float32)
        nsum = np.empty((m, kb), dtype=np.int32)
        self._lib.edge_sd_quantize(x.ctypes.data, m, self.cols, xq.ctypes.data, dx.ctypes.data, nsum.ctypes.data)
        self._parallel(self._lib.edge_sd_rows, (self._packed.ctypes.data, self._scales.ctypes.data, kb,
                                                xq.ctypes.data, dx.ctypes.data, nsum.ctypes.data, m,
                                                out.ctypes.data, out.strides[0] // 4))
        return out


# Rows read from the weights file at a time while the head is repacked: the file's bytes pass through a
# buffer this size instead of being mapped whole beside the repacked copy (the load's peak of memory).
LOAD_ROWS = 16384


def from_engine(folder: Path, spec: dict[str, Any], threads: int) -> LmHead:
    """The head an export recorded (manifest `lm_head`), its blocks read from the engine's weights file."""
    rows, cols = int(spec["rows"]), int(spec["cols"])
    data = folder / spec["file"]
    (w_at, w_len), (s_at, s_len) = spec["weight"], spec["scales"]
    if w_len != rows * cols or s_len != rows * (cols // BLOCK) * 4:
        raise ArtifactError(f"{data}: the LM head's recorded sizes do not match {rows} x {cols}")
    head = LmHead(rows, cols, threads)
    step = min(rows, LOAD_ROWS)
    weight = np.empty((step, cols), dtype=np.uint8)
    scales = np.empty((step, cols // BLOCK), dtype=np.float32)
    with open(data, "rb") as f:
        for first in range(0, rows, step):
            n = min(step, rows - first)
            for buffer, at in ((weight[:n], w_at + first * cols), (scales[:n], s_at + first * (cols // BLOCK) * 4)):
                f.seek(at)
                if f.readinto(buffer.reshape(-1).view(np.uint8).data) != buffer.nbytes:
                    raise ArtifactError(f"{data} ends inside the LM head's blocks")
            try:
                head.load(weight[:n], scales[:n], first)
            except ValueError as e:
                raise ArtifactError(f"{data}: {e}") from None
    return head
