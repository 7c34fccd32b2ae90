"""Forwards that cross a multiple of SPLIT_AT positions compute what plain decoding's steps compute.

Plain decoding steps one position at a time over a graph whose attention reads the previous position
back from the cache (a gguf target), or two at a time (`min_step_positions` 2); a verification forward
covers several. On some CPUs a forward that spans position 64 computes its positions otherwise than the
steps do (engines/engine.py, SPLIT_AT), so the engine runs such a forward as the steps meet it. Checked
here as the loop would meet it: after plain steps to each length T, a forward of the last S positions
(fed again) gives every one of its positions the logits the steps gave it (engines/consistency.py,
across_split, which export validation runs too).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_sd.engines import ort as ort_engine
from edge_sd.engines.ort import OrtEngine


def test_a_forward_across_a_split_runs_as_one_position_steps_meet_it(gguf_root: Path, monkeypatch) -> None:
    """Which forwards run, with one-position steps (what a gguf target steps where the CPU's kernels
    allow: below, test_forwards_across_64_positions_agree_with_plain_steps), over ONNX Runtime's
    attention."""
    monkeypatch.setenv("EDGE_SD_ATTENTION", "0")
    engine = OrtEngine(gguf_root / "pair" / "target", provider="cpu", threads=2, min_step_positions=1)
    assert engine.min_step == 1 and engine.manifest.previous_row_attention and ort_engine.SPLIT_AT == 64
    ids = list(range(3, 3 + 80))
    engine.forward(np.asarray(ids[:62]))
    fed = record_fed(engine)
    logits = engine.forward(np.asarray(ids[62:67]))  # positions 62..66, across 64
    assert fed == [ids[62:64], ids[64:67]]  # its part up to 64, its part from 64: nothing fed again
    assert logits.shape[0] == 5 and engine.n_cached == 67 and engine.cached_ids.tolist() == ids[:67]
    engine.truncate(62)
    first = engine.forward(np.asarray(ids[62:64]))
    second = engine.forward(np.asarray(ids[64:67]))
    np.testing.assert_array_equal(logits, np.concatenate([first, second]))
    # One that starts at 63 is split too (its row 63 as the step ending there gave it); one that
    # starts at 64, or ends at 64, runs as it is.
    for start, end, parts in ((63, 67, [ids[63:64], ids[64:67]]), (64, 67, [ids[64:67]]), (60, 64, [ids[60:64]])):
        fed.clear()
        engine.truncate(start)
        engine.forward(np.asarray(ids[start:end]))
        assert fed == parts and engine.cached_ids.tolist() == ids[:end]


def test_a_forward_across_a_split_runs_as_two_position_steps_meet_it(gguf_root: Path, monkeypatch) -> None:
    monkeypatch.setenv("EDGE_SD_ATTENTION", "0")  # ONNX Runtime's attention: edge-sd's never splits
    engine = OrtEngine(gguf_root / "pair" / "target", provider="cpu", threads=2, min_step_positions=2)
    assert engine.min_step == 2 and ort_engine.SPLIT_AT == 64
    ids = list(range(3, 3 + 80))
    engine.forward(np.asarray(ids[:62]))
    before = engine.forward_count
    logits = engine.forward(np.asarray(ids[62:67]))  # positions 62..66, across 64
    assert engine.forward_count - before == 2  # its part up to 64, its part from 63
    assert logits.shape[0] == 5 and engine.n_cached == 67
    assert engine.cached_ids.tolist() == ids[:67]
    # The rows as the two parts give them: 62..63 from a forward ending at 64, 64..66 from one
    # starting at 63 (where plain decoding's steps last write position 63).
    engine.truncate(62)
    first = engine.forward(np.asarray(ids[62:64]))
    engine.truncate(63)
    second = engine.forward(np.asarray(ids[63:67]), last=3)
    np.testing.assert_array_equal(logits, np.concatenate([first, second]))
    # A forward that ends at 64 is not split; one that starts at 63 is (its row 63 as plain
    # decoding's step ending there gave it); one that starts at 64 feeds 63 again, as the steps do.
    fed = record_fed(engine)
    engine.truncate(60)
    engine.forward(np.asarray(ids[60:64]))
    assert fed == [ids[60:64]]
    fed.clear()
    engine.truncate(63)
    rows = engine.forward(np.asarray(ids[63:67]))
    assert fed == [ids[62:64], ids[63:67]] and engine.n_cached == 67
    np.testing.assert_array_equal(rows, np.concatenate([first[1:], second]))
    fed.clear()
    engine.truncate(64)
    assert engine.forward(np.asarray(ids[64:67])).shape[0] == 3
    assert fed == [ids[63:67]] and engine.cached_ids.tolist() == ids[:67]
    # Away from a multiple of 64, a forward of two or more positions runs as it is.
    fed.clear()
    engine.truncate(40)
    engine.forward(np.asarray(ids[40:43]))
    assert fed == [ids[40:43]]


def test_over_edge_sds_attention_no_forward_is_split_and_each_computes_what_the_steps_do(
        gguf_root: Path, monkeypatch) -> None:
    """Where edge-sd's kernel computes every attention of the graph (engines/attention.py), each row
    is computed alike in any forward: forwards across 64 and 128 run whole, and every row equals the
    one-position step's bit for bit. ONNX Runtime's node is the control: the same forwards are split."""
    from edge_sd.engines import attention
    from edge_sd.engines.consistency import across_split

    if attention.library()[0] is None:
        pytest.skip(f"the kernel did not build: {attention.library()[1]}")
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 400, size=150)]
    for choice in ("1", "0"):
        monkeypatch.setenv("EDGE_SD_ATTENTION", choice)
        engine = OrtEngine(gguf_root / "pair" / "target", provider="cpu", threads=2, min_step_positions=1)
        assert engine.shared.attention_by_kernel == (choice == "1")
        engine.forward(np.asarray(ids[:60]))
        fed = record_fed(engine)
        engine.forward(np.asarray(ids[60:70]))
        assert (fed == [ids[60:70]]) == (choice == "1")
        if choice == "1":
            engine._io = engine._io._io
            assert across_split(engine, ids, range(56, 140), sizes=(3, 9, 17)) == 0.0


def record_fed(engine: OrtEngine) -> list[list[int]]:
    """The input ids of each ONNX Runtime run of the engine, from now on."""
    fed: list[list[int]] = []
    io = engine._io

    class Recording:
        _io = io

        def __getattr__(self, name):
            return getattr(io, name)

        def bind_cpu_input(self, name, value):
            if name == "input_ids":
                fed.append(value.reshape(-1).tolist())
            io.bind_cpu_input(name, value)

    engine._io = Recording()
    return fed


@pytest.mark.parametrize("steps", [None, 2])
def test_forwards_across_64_positions_agree_with_plain_steps(gguf_root: Path, steps: int | None) -> None:
    """Steps as the export measured them on this CPU (one position where a one-position step computes
    what longer forwards do: AVX-512 CPUs; else two), or two (the same graph re-feeding)."""
    from edge_sd.engines.consistency import across_split

    engine = OrtEngine(gguf_root / "pair" / "target", provider="cpu", threads=2, min_step_positions=steps)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, engine.manifest.vocab_size, size=140)]
    assert across_split(engine, ids, range(14, 140)) == 0.0
    assert engine.min_step == (steps or engine.manifest.min_step_positions)


def test_export_and_load_checks_measure_forwards_across_the_split(gguf_root: Path, monkeypatch) -> None:
    """consistency.across_split, which export validation and the load-time check add to the
    steps-against-forward figure: 0 on the tiny target, and it sees forwards that compute otherwise."""
    from edge_sd.engines import consistency

    engine = OrtEngine(gguf_root / "pair" / "target", provider="cpu", threads=2)  # steps as measured
    ids = np.random.default_rng(1).integers(3, engine.manifest.vocab_size, size=consistency.SPLIT_IDS)
    assert consistency.across_split(engine, ids) == 0.0
    assert engine.n_cached == 0
    forward = OrtEngine.forward

    def skewed(self, fed, last=None, split=True):  # a kernel that rounds otherwise for 3 positions and more
        out = forward(self, fed, last, split)
        return out + 1e-3 if len(np.asarray(fed).reshape(-1)) >= 3 else out

    monkeypatch.setattr(OrtEngine, "forward", skewed)
    assert consistency.across_split(engine, ids) > 0.0

    def first_row(self, fed, last=None, split=True):  # ... only in the first row: a verification reads it
        out = forward(self, fed, last, split).copy()
        if len(np.asarray(fed).reshape(-1)) >= 3 and len(out) >= 3:
            out[0] += 1e-3
        return out

    monkeypatch.setattr(OrtEngine, "forward", first_row)
    assert consistency.across_split(engine, ids) > 0.0


def test_the_checks_cover_the_longest_verification_forward() -> None:
    """Export validation and the load-time check compare forwards as long as auto's longest draft
    verifies (a prompt lookup's, and the position after it) with the steps."""
    from edge_sd.engines.consistency import SPLIT_SIZES
    from edge_sd.schedules.choose import DEFAULT_MAX_LOOKAHEAD, DEFAULT_MAX_LOOKUP

    assert max(SPLIT_SIZES) == max(DEFAULT_MAX_LOOKUP, DEFAULT_MAX_LOOKAHEAD) + 1
