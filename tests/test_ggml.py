"""GGML block formats unpacked into MatMulNBits' terms: weights equal to gguf's own dequantization, bit
for bit, on blocks of every supported type (random bytes with finite fp16 scales, and real quantizers
where gguf has them)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sd.errors import ExportError, UsageError
from edge_sd.export.ggml import FORMATS, Blocks, concat, unpack

gguf = pytest.importorskip("gguf")

# Byte offsets of each type's fp16 fields within a block (random bytes there could be NaN or inf).
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
          "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_rows(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    per_block, size, _ = FORMATS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // per_block, size), dtype=np.uint8)
    for at in F16_AT[type_name]:
        raw[:, at : at + 2] = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def reference(type_name: str, raw: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", list(FORMATS))
def test_unpacked_weights_equal_gguf_dequantization(type_name: str) -> None:
    rows, cols = 6, 512
    raw = random_rows(type_name, rows, cols)
    b = unpack("w", type_name, raw, cols)
    ref = reference(type_name, raw)
    assert ref.shape == (rows, cols) and b.shape == (rows, cols)
    assert b.q.max() < 2**b.bits and b.block in (16, 32)
    np.testing.assert_array_equal(b.weights(), ref)  # bit for bit, not approximately
    # The same weights stored wider, in finer blocks, with offsets: what a fused projection takes.
    np.testing.assert_array_equal(b.refined(8, 16, True).weights(), ref)
    np.testing.assert_array_equal(b.rows(np.array([5, 0, 2])).weights(), ref[[5, 0, 2]])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_real_quantizer_output(type_name: str) -> None:
    """Blocks made by gguf's own quantizers (the bit patterns real files hold)."""
    w = np.random.default_rng(1).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    b = unpack("w", type_name, raw, 256)
    np.testing.assert_array_equal(b.weights(), reference(type_name, raw))
    assert np.abs(b.weights() - w).max() < 0.5  # and they are the matrix, quantized


def test_fused_rows_of_mixed_types() -> None:
    """A fused q/k/v projection whose parts are Q5_0, Q4_K and Q6_K: one storage, the same weights."""
    parts = {t: random_rows(t, 4, 256, seed=i) for i, t in enumerate(["Q5_0", "Q4_K", "Q6_K"])}
    fused = concat([unpack(t, t, raw, 256) for t, raw in parts.items()])
    assert (fused.bits, fused.block, fused.offset is not None) == (8, 16, True)
    np.testing.assert_array_equal(fused.weights(), np.concatenate([reference(t, r) for t, r in parts.items()]))


def test_unsupported_type_is_refused_by_name() -> None:
    with pytest.raises(UsageError, match="blk.3.ffn_up.weight is IQ4_XS.*--precision fp32"):
        unpack("blk.3.ffn_up.weight", "IQ4_XS", np.zeros((1, 136), np.uint8), 256)
    with pytest.raises(ExportError, match="bytes a row"):
        unpack("w", "Q8_0", np.zeros((1, 33), np.uint8), 32)


def test_blocks_shape() -> None:
    b = Blocks(np.zeros((2, 32), np.uint8), np.ones((2, 1), np.float32), np.zeros((2, 1), np.uint8), None, 4, 32)
    assert b.shape == (2, 32) and not b.weights().any()


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K"])
def test_centred_blocks_keep_the_weights(type_name: str) -> None:
    """Formats with a minimum are stored centred, w = s*(q - c) + (o + c*s): the same weights to within
    float32 rounding, values on both sides of the zero point, 4-bit storage on the kernel's default 8."""
    raw = random_rows(type_name, 6, 512)
    b = unpack("w", type_name, raw, 512)
    c = b.centred()
    ref = reference(type_name, raw)
    tol = 8 * np.finfo(np.float32).eps * np.abs(ref).max(axis=1, keepdims=True)
    assert (np.abs(c.weights() - ref) <= tol).all()
    values = c.q.astype(np.int16) - np.repeat(c.zero, c.block, axis=1)
    assert values.min() < 0 < values.max()
    if c.bits == 4:
        assert (c.zero == 8).all()
    six = unpack("w", "Q6_K", random_rows("Q6_K", 2, 256), 256)
    assert six.centred() is six  # no minimum: as it was


def test_centred_fused_rows_centre_only_the_blocks_with_a_minimum() -> None:
    """Q4_K rows fused with Q6_K rows (8-bit storage): Q4_K's values centred on 8, not on Q6_K's 32."""
    parts = [unpack(t, t, random_rows(t, 4, 256, seed=i), 256) for i, t in enumerate(["Q4_K", "Q6_K"])]
    fused = concat(parts).centred()
    assert (fused.zero[:4] == 8).all() and (fused.zero[4:] == 32).all()
    np.testing.assert_allclose(fused.weights(), concat(parts).weights(), rtol=0, atol=1e-6)


def test_centring_cancels_the_int8_rounding_of_the_activations() -> None:
    """What centring is for: with activations rounded to int8 per block (as MatMulNBits at accuracy level 4
    does) and the minimum's term taken from exact sums, all-positive values carry the rounding of every
    activation into the product; centred, the error is llama.cpp's (the whole dot product from the same
    int8 activations)."""
    w = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32) * 0.05
    b = unpack("w", "Q4_1", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), 256)  # as Q4_K: s*q + o
    x = np.random.default_rng(4).standard_normal((32, 256)).astype(np.float64)
    blocks = x.reshape(32, -1, b.block)
    sx = np.abs(blocks).max(axis=-1, keepdims=True) / 127
    xq = (np.round(blocks / sx) * sx).reshape(32, 256)
    sums = blocks.sum(axis=-1)
    exact = x @ b.weights().T.astype(np.float64)

    def error(blk: Blocks) -> float:
        body = blk.scale.repeat(blk.block, axis=1) * (blk.q.astype(np.float64) - blk.zero.repeat(blk.block, axis=1))
        return float(np.abs(xq @ body.T + sums @ blk.offset.T - exact).mean())  # type: ignore[union-attr]

    llama_cpp = float(np.abs(xq @ b.weights().T - exact).mean())
    assert error(b.centred()) < 0.6 * error(b)
    assert error(b.centred()) < 1.3 * llama_cpp
