"""GGML block formats as ONNX Runtime's MatMulNBits reads them: integer values, per-block scales and
integer zero points, and (formats with a minimum) per-block offsets, exactly.

Every format llama.cpp stores a weight matrix in row by row is a scale times an integer per block of
16 or 32 weights (the K-quants nest 16 or 8 such blocks in a super-block, each block's scale the
product of the super-block's fp16 scale and a small integer), and Q4_1, Q5_1, Q2_K, Q4_K and Q5_K add
a per-block offset. `unpack` turns a tensor's raw bytes into `Blocks`: values q below 2**bits, and
per block a float32 scale s, an integer zero point z and an offset o, so that each weight is
`s * (q - z) + o`, computed in float32 in the order `gguf`'s own dequantization computes it (the scale
of a K-quant block is the same float32 product). `Blocks.weights` evaluates that, and the export
checks it against `gguf.quants.dequantize` bit for bit (export/gguf_graph.py). Blocks with an offset
are then stored centred (`Blocks.centred`), equal to the file's weights to within float32 rounding.

Values are stored 8 bits wide unless they fit in 4 (MatMulNBits takes 4 or 8); block sizes are
kept (MatMulNBits takes powers of two from 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_sd.errors import ExportError, UsageError

QK_K = 256  # weights in a K-quant super-block


@dataclass
class Blocks:
    """A matrix [rows, cols] of block-quantized weights: w = scale * (q - zero) + offset per block of
    `block` consecutive weights of a row."""

    q: np.ndarray  # [rows, cols] uint8, each below 2**bits
    scale: np.ndarray  # [rows, cols // block] float32
    zero: np.ndarray  # [rows, cols // block] uint8
    offset: np.ndarray | None  # [rows, cols // block] float32, or None: no offsets
    bits: int  # storage width: 4 or 8
    block: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    def weights(self) -> np.ndarray:
        """The float32 weights [rows, cols], rounded as gguf's dequantization rounds them."""
        scale = np.repeat(self.scale, self.block, axis=1)
        w = scale * (self.q.astype(np.float32) - np.repeat(self.zero, self.block, axis=1).astype(np.float32))
        if self.offset is not None:
            w = w + np.repeat(self.offset, self.block, axis=1)
        return w.astype(np.float32)

    def rows(self, index: np.ndarray) -> Blocks:
        """These rows, in this order."""
        return Blocks(self.q[index], self.scale[index], self.zero[index],
                      None if self.offset is None else self.offset[index], self.bits, self.block)

    def centred(self) -> Blocks:
        """The same weights with each offset block's values centred on zero: w = s*(q - c) + (o + c*s),
        c half the values' range. Why: ONNX Runtime quantizes the activations to int8, and the rounding
        of x . (s*q) for all-positive q does not cancel (llama.cpp, which takes the minimum's term from
        the same int8 activations, has no such bias); centred, only the rounding of x . (s*(q - c))
        remains, and the exact fp32 block sums carry the rest. The weights then equal the file's to
        within one float32 rounding instead of bit for bit. 4-bit storage is shifted onto the
        kernel's default zero point 8, so no zero points are read."""
        if self.offset is None:
            return self
        lift = self.zero == 0  # blocks whose values all lie above their zero point
        lifted = np.repeat(lift, self.block, axis=1)
        top = int(self.q[lifted].max(initial=0))
        if top == 0:
            return self
        c = 1 << (top.bit_length() - 1)
        zero, offset, q = self.zero.copy(), self.offset.copy(), self.q
        offset[lift] += c * self.scale[lift]
        if self.bits == 4:
            q = (q + lifted * np.uint8(8 - c)).astype(np.uint8)
            zero[lift] = 8
        else:
            zero[lift] = c
        return Blocks(q, self.scale, zero, offset, self.bits, self.block)

    def refined(self, bits: int, block: int, offset: bool) -> Blocks:
        """The same weights, stored at least `bits` wide, in blocks of `block` (a divisor of this
        block size: each scale is repeated), with an offset array (zeros) when `offset`."""
        if self.block % block or bits < self.bits:
            raise ValueError(f"cannot store {self.bits}-bit blocks of {self.block} as {bits}-bit blocks of {block}")
        r = self.block // block
        off = self.offset if self.offset is not None or not offset else np.zeros_like(self.scale)
        return Blocks(self.q, np.repeat(self.scale, r, axis=1), np.repeat(self.zero, r, axis=1),
                      None if off is None else np.repeat(off, r, axis=1), bits, block)


def concat(parts: list[Blocks]) -> Blocks:
    """Rows of several matrices stacked (a fused projection), in the finest common storage."""
    bits = max(p.bits for p in parts)
    block = min(p.block for p in parts)
    offset = any(p.offset is not None for p in parts)
    parts = [p.refined(bits, block, offset) for p in parts]
    return Blocks(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                  np.concatenate([p.zero for p in parts]),
                  np.concatenate([p.offset for p in parts]) if offset else None,  # type: ignore[misc]
                  bits, block)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from pairs of bytes [..., 2] -> float32 [..., 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, groups: int) -> np.ndarray:
    """Bytes [n, groups * L] -> 4-bit values [n, groups, 2 * L]: per group of L bytes, the low
    nibbles of the group, then its high nibbles (the order every GGML 4-bit format uses)."""
    n = qs.shape[0]
    g = qs.reshape(n, groups, 1, -1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (g & 0x0F).reshape(n, groups, -1)


def _crumbs(qs: np.ndarray, groups: int) -> np.ndarray:
    """Bytes [n, groups * 32] -> 2-bit values [n, groups * 128]: per group of 32 bytes, bits 0-1 of
    each byte, then bits 2-3, 4-5 and 6-7 (the order of Q2_K, Q3_K and Q6_K's high bits)."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, groups, 1, 32) >> shifts) & 3).reshape(n, -1)


def _bits_of(mask: np.ndarray, count: int) -> np.ndarray:
    """Bytes [n, L] -> bit j of each byte, [n, count, L], j = 0..count-1."""
    n = mask.shape[0]
    return (mask.reshape(n, 1, -1) >> np.arange(count, dtype=np.uint8).reshape(1, count, 1)) & 1


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K / Q5_K super-block -> eight 6-bit scales and eight 6-bit minimums."""
    n = packed.shape[0]
    p = packed.reshape(n, 3, 4)
    d, m, md = p[:, 0], p[:, 1], p[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _legacy(raw: np.ndarray, kind: str) -> Blocks:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32 with one fp16 scale (and an fp16 minimum)."""
    n = raw.shape[0]
    d = _f16(raw[:, :2])
    at = 2
    m = None
    if kind in ("q4_1", "q5_1"):
        m, at = _f16(raw[:, 2:4]), 4
    if kind == "q8_0":
        q = (raw[:, at:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Blocks(q, d, np.full((n, 1), 128, np.uint8), None, 8, 32)
    high = None
    if kind in ("q5_0", "q5_1"):
        high = _bits_of(raw[:, at : at + 4], 8).transpose(0, 2, 1).reshape(n, 32)  # bit j of the uint32
        at += 4
    q = _nibbles(raw[:, at:], 1).reshape(n, 32)
    if high is not None:
        q = q | (high << 4)
    if m is not None:
        return Blocks(q, d, np.zeros((n, 1), np.uint8), m, 8 if high is not None else 4, 32)
    zero = 16 if high is not None else 8
    return Blocks(q, d, np.full((n, 1), zero, np.uint8), None, 8 if high is not None else 4, 32)


def _q2_k(raw: np.ndarray) -> Blocks:
    n = raw.shape[0]
    scales, qs = raw[:, :16], raw[:, 16:80]
    d, dmin = _f16(raw[:, 80:82]), _f16(raw[:, 82:84])
    q = _crumbs(qs, 2)
    scale = d * (scales & 0x0F).astype(np.float32)
    offset = -(dmin * (scales >> 4).astype(np.float32))
    return Blocks(q, scale, np.zeros((n, 16), np.uint8), offset, 4, 16)


def _q3_k(raw: np.ndarray) -> Blocks:
    n = raw.shape[0]
    hmask, qs, packed = raw[:, :32], raw[:, 32:96], raw[:, 96:108]
    d = _f16(raw[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int16) - 32
    ql = _crumbs(qs, 2)
    hbit = _bits_of(hmask, 8).reshape(n, QK_K)
    # value = ql - 4 where the high bit is clear: stored as ql + 4 * hbit, zero point 4
    q = (ql + (hbit << 2)).astype(np.uint8)
    return Blocks(q, d * sc.astype(np.float32), np.full((n, 16), 4, np.uint8), None, 4, 16)


def _q45_k(raw: np.ndarray, five: bool) -> Blocks:
    n = raw.shape[0]
    d, dmin = _f16(raw[:, :2]), _f16(raw[:, 2:4])
    sc, mn = _k_scales(raw[:, 4:16])
    at = 16
    high = None
    if five:
        high = _bits_of(raw[:, 16:48], 8).reshape(n, QK_K)  # sub-block j: bit j of the 32 bytes
        at = 48
    q = _nibbles(raw[:, at:], 4).reshape(n, QK_K)
    if high is not None:
        q = q | (high << 4)
    return Blocks(q.astype(np.uint8), d * sc.astype(np.float32), np.zeros((n, 8), np.uint8),
                  -(dmin * mn.astype(np.float32)), 8 if five else 4, 32)


def _q6_k(raw: np.ndarray) -> Blocks:
    n = raw.shape[0]
    ql, qh, scales = raw[:, :128], raw[:, 128:192], raw[:, 192:208]
    d = _f16(raw[:, 208:210])
    q = _nibbles(ql, 2).reshape(n, QK_K) | (_crumbs(qh, 2) << 4)
    return Blocks(q, d * scales.view(np.int8).astype(np.float32), np.full((n, 16), 32, np.uint8), None, 8, 16)


# GGML type name -> (weights per block, bytes per block, unpacker of [n_blocks, bytes] rows)
FORMATS = {
    "Q4_0": (32, 18, lambda r: _legacy(r, "q4_0")),
    "Q4_1": (32, 20, lambda r: _legacy(r, "q4_1")),
    "Q5_0": (32, 22, lambda r: _legacy(r, "q5_0")),
    "Q5_1": (32, 24, lambda r: _legacy(r, "q5_1")),
    "Q8_0": (32, 34, lambda r: _legacy(r, "q8_0")),
    "Q2_K": (QK_K, 84, _q2_k),
    "Q3_K": (QK_K, 110, _q3_k),
    "Q4_K": (QK_K, 144, lambda r: _q45_k(r, five=False)),
    "Q5_K": (QK_K, 176, lambda r: _q45_k(r, five=True)),
    "Q6_K": (QK_K, 210, _q6_k),
}
# Types whose values are plain floats: the fp32 graph computes with them exactly as they are.
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def unpack(name: str, type_name: str, raw: np.ndarray, cols: int) -> Blocks:
    """The blocks of a GGUF tensor: raw bytes [rows, bytes per row] of type `type_name`, `cols`
    weights a row. Raises UsageError naming the tensor for a type it cannot carry exactly."""
    if type_name not in FORMATS:
        known = ", ".join([*FORMATS, *FLOAT_TYPES])
        raise UsageError(f"GGUF tensor {name} is {type_name}, which edge-sd cannot carry exactly into ONNX "
                          f"Runtime (it can: {known}); export with --precision fp32 (dequantized) instead")
    per_block, size, fn = FORMATS[type_name]
    rows = raw.shape[0]
    if cols % per_block or raw.shape[1] != cols // per_block * size:
        raise ExportError(f"GGUF tensor {name} ({type_name}): {raw.shape[1]} bytes a row for {cols} weights")
    b = fn(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size))
    per_row = cols // b.block
    return Blocks(b.q.reshape(rows, cols), b.scale.reshape(rows, per_row).astype(np.float32),
                  b.zero.reshape(rows, per_row),
                  None if b.offset is None else b.offset.reshape(rows, per_row).astype(np.float32), b.bits, b.block)
