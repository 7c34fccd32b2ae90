"""The LM head computed outside the graph (engines/lm_head.py): its products against a float64
reference of the same int8 activations, every row computed alike whatever is beside it, and the
engines that use it on a GGUF target (speculative decoding under it: tests/test_gguf.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_sd.engines import lm_head
from edge_sd.errors import ArtifactError

no_compiler = lm_head.library()[0] is None
pytestmark = pytest.mark.skipif(no_compiler, reason=f"the kernel cannot be built here: {lm_head.library()[1]}")


def _paths() -> list:
    """The portable C loop always; the AVX-512 VNNI one where the CPU has it."""
    vnni = not no_compiler and bool(lm_head.library()[0].edge_sd_vnni())
    return [True, pytest.param(False, marks=pytest.mark.skipif(not vnni, reason="this CPU has no AVX-512 VNNI"))]


def _head(rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (rows, cols), dtype=np.uint8),  # scales that halves hold, as GGUF's
            rng.uniform(1e-3, 2e-2, (rows, cols // 32)).astype(np.float16).astype(np.float32))


def _reference(w: np.ndarray, s: np.ndarray, x: np.ndarray, shift_scales: int = 0) -> np.ndarray:
    """float64 products of each row of x quantized as the kernel documents it: per block of 32, the
    largest magnitude over 127, values rounded to nearest even in float32. shift_scales: read each
    block's activation scale from another block (a wrong reference)."""
    m, cols = x.shape
    kb = cols // 32
    xb = x.reshape(m, kb, 32).astype(np.float32)
    amax = np.abs(xb).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.float64)
    d = np.roll((amax / np.float32(127)).astype(np.float64), shift_scales, axis=1)
    dots = np.einsum("nbi,rbi->rnb", w.reshape(len(w), kb, 32).astype(np.float64) - 128, q)
    return (dots * s.astype(np.float64)[None] * d[:, None, :]).sum(-1)


@pytest.mark.parametrize("portable", _paths())
def test_products_equal_a_float64_reference(portable: bool) -> None:
    w, s = _head(8 * 37, 96)  # 37 groups of rows: nine tiles of four and one alone
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    x[1, 32:64] = 0.0  # a block of zeros: its scale is 0
    x[2] *= 1e3
    y = lm_head.LmHead.of(w, s, threads=2, portable=portable)(x)
    ref = _reference(w, s, x)
    scale = np.abs(ref).max(axis=1, keepdims=True)
    worst = (np.abs(y - ref) / scale).max()
    assert worst < 1e-5, worst
    # The negative control: the same comparison against a reference with its scales in the wrong blocks
    assert not (np.abs(y - _reference(w, s, x, shift_scales=1)) < 1e-5 * scale).all()


@pytest.mark.parametrize("portable", _paths())
def test_each_row_is_computed_alike_whatever_is_beside_it(portable: bool) -> None:
    """A verification forward's rows must be what single steps give, bit for bit."""
    w, s = _head(8 * 50, 64, seed=2)
    x = np.random.default_rng(3).standard_normal((7, 64)).astype(np.float32)
    together = lm_head.LmHead.of(w, s, threads=1, portable=portable)(x)
    head = lm_head.LmHead.of(w, s, threads=3, portable=portable)
    np.testing.assert_array_equal(head(x), together)
    for i in range(len(x)):
        np.testing.assert_array_equal(head(x[i : i + 1])[0], together[i])
    out = np.zeros((2, 8 * 50), np.float32)
    assert head(x[2:4], out) is out
    np.testing.assert_array_equal(out, together[2:4])


@pytest.mark.skipif(no_compiler or not lm_head.library()[0].edge_sd_vnni(), reason="this CPU has no AVX-512 VNNI")
def test_the_portable_loop_computes_what_the_vnni_one_does() -> None:
    """The same float operations in both paths: a CPU without VNNI gets the same logits, bit for bit,
    from every tile (four groups or the last one alone, one to three rows) and thread count."""
    w, s = _head(8 * 37, 160, seed=5)
    x = np.random.default_rng(6).standard_normal((8, 160)).astype(np.float32)
    portable = lm_head.LmHead.of(w, s, threads=1, portable=True)
    for threads in (1, 2, 5):
        vnni = lm_head.LmHead.of(w, s, threads=threads)
        for m in (1, 2, 3, 4, 8):
            np.testing.assert_array_equal(vnni(x[:m]), portable(x[:m]))


def test_what_the_kernel_cannot_take_is_refused() -> None:
    w, s = _head(16, 64)
    with pytest.raises(ValueError, match="blocks of 32"):
        lm_head.LmHead.of(w[:12], s[:12])
    with pytest.raises(ValueError, match="blocks of 32"):
        lm_head.LmHead.of(w[:, :48], s[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        lm_head.LmHead.of(w.astype(np.int8), s)
    with pytest.raises(ValueError, match="halves"):
        lm_head.LmHead.of(w, s + np.float32(1e-7))
    with pytest.raises(ValueError, match="float32 array"):
        lm_head.LmHead.of(w, s)(np.zeros((2, 64), np.float32), np.zeros((1, 16), np.float32))


def test_the_environment_turns_it_off_and_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lm_head.ENV, "0")
    assert lm_head.wanted() == (False, "EDGE_SD_LM_HEAD=0")
    monkeypatch.setenv(lm_head.ENV, "1")
    assert lm_head.wanted() == (True, "")


def test_a_gguf_target_computes_its_head_here_as_its_graph_does(gguf_root: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The export records the tiny target's Q8_0 head; an engine computing it here gives the graph's
    logits to within the two kernels' float rounding, the same argmax, and a several-position
    forward's rows equal to single steps'."""
    from edge_sd.engines.session import OrtSession
    from edge_sd.manifest import load_engine_manifest

    folder = gguf_root / "pair" / "target"
    m = load_engine_manifest(folder)
    assert m.lm_head["rows"] == m.logits_width and m.lm_head["output"] in m.output_names
    assert load_engine_manifest(gguf_root / "pair" / "drafter").lm_head == {}
    ids = np.arange(5, 45)
    monkeypatch.setenv(lm_head.ENV, "0")
    graph = OrtSession(folder, provider="cpu", threads=2)
    assert graph.head is None
    expected = graph.engine().forward(ids)
    monkeypatch.setenv(lm_head.ENV, "1")
    own = OrtSession(folder, provider="cpu", threads=2)
    assert own.head is not None
    engine = own.engine()
    got = engine.forward(ids)
    assert got.shape == expected.shape
    np.testing.assert_array_less(np.abs(got - expected), 1e-4 * np.abs(expected).max())
    np.testing.assert_array_equal(got.argmax(-1), expected.argmax(-1))
    engine.reset()
    engine.forward(ids[:30])
    steps = [engine.forward(ids[i : i + 1]).copy() for i in range(30, 34)]
    engine.truncate(30)
    np.testing.assert_array_equal(engine.forward(ids[30:34], scratch=True), np.concatenate(steps))
    # Read from the file in runs of rows (the last one shorter), the head is the same
    monkeypatch.setattr(lm_head, "LOAD_ROWS", 24)
    hidden = np.random.default_rng(4).standard_normal((3, m.lm_head["cols"])).astype(np.float32)
    np.testing.assert_array_equal(lm_head.from_engine(folder, m.lm_head, 2)(hidden), own.head(hidden))
    # A record that points at other bytes is refused at load, not read as a head
    copy = tmp_path / "target"
    shutil.copytree(folder, copy)
    spec = dict(m.lm_head, weight=[m.lm_head["weight"][0], m.lm_head["weight"][1] - 1])
    with pytest.raises(ArtifactError, match="recorded sizes"):
        lm_head.from_engine(copy, spec, 1)
