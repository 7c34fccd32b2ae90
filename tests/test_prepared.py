"""What a first load leaves beside an engine for later loads (engines/prepared.py, vocab.Tables): the
later loads must compute and spell exactly what a load without it does, and a stale, damaged or
unwritable cache must only cost time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from edge_sd.engines import prepared
from edge_sd.engines.ort import OrtEngine, OrtSession
from edge_sd.vocab import TABLES_FILE, Tables, Vocab

# Forward sizes of a short generation: a prompt, plain steps, verification forwards.
SIZES = (7, 1, 1, 3, 2, 1, 4, 1)


@pytest.fixture
def target(gguf_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the tiny gguf target (MatMulNBits weights, a tied Q8_0 embedding and head), cached
    whatever its size."""
    folder = tmp_path / "target"
    shutil.copytree(gguf_root / "pair" / "target", folder, ignore=shutil.ignore_patterns(prepared.CACHE_DIR))
    monkeypatch.setattr(prepared, "MIN_BYTES", 0)
    monkeypatch.delenv(prepared.ENV, raising=False)
    return folder


def _logits(session: OrtSession) -> list[np.ndarray]:
    engine = OrtEngine(session)
    rng = np.random.default_rng(0)
    return [engine.forward(rng.integers(3, 300, size=s)) for s in SIZES]


def _session(folder: Path) -> OrtSession:
    return OrtSession(folder, provider="cpu", threads=2)


def test_a_saved_graph_computes_what_the_engine_does(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert prepared.size(target) is None
    first = _session(target)
    assert first.graph_cache == "saved"
    saved = target / prepared.CACHE_DIR / prepared.ORT_DIR
    assert {p.name for p in saved.iterdir()} == {prepared.MODEL, prepared.DATA, prepared.KEY_FILE}
    assert prepared.size(target) > (target / "model.onnx.data").stat().st_size  # what `inspect` shows
    later = _session(target)
    assert later.graph_cache == "loaded"
    monkeypatch.setenv(prepared.ENV, "0")
    plain = _session(target)
    assert plain.graph_cache == ""
    for a, b, c in zip(_logits(plain), _logits(first), _logits(later), strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_a_changed_engine_or_damaged_cache_is_prepared_again(target: Path) -> None:
    assert _session(target).graph_cache == "saved"
    model = target / "model.onnx"
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the engine was replaced
    assert _session(target).graph_cache == "saved"
    saved = target / prepared.CACHE_DIR / prepared.ORT_DIR / prepared.MODEL
    saved.write_bytes(b"not a graph")
    assert _session(target).graph_cache == "saved"
    assert _session(target).graph_cache == "loaded"
    assert not [p for p in (target / prepared.CACHE_DIR).iterdir() if p.name.startswith(".")]  # no leftovers


def test_an_unwritable_folder_or_the_switch_loads_without_a_cache(target: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (target / prepared.CACHE_DIR).write_text("a file where the cache folder would go")
    assert _session(target).graph_cache == ""
    (target / prepared.CACHE_DIR).unlink()
    # ONNX Runtime fails the load when it cannot write the graph (a full disk): loaded without saving.
    save_to = prepared.save_to

    def failing(opts, folder: Path) -> Path | None:
        tmp = save_to(opts, folder)
        opts.optimized_model_filepath = str(target / "no such folder" / prepared.MODEL)
        return tmp

    with monkeypatch.context() as m:
        m.setattr(prepared, "save_to", failing)
        session = _session(target)
    assert session.graph_cache == "" and not list((target / prepared.CACHE_DIR).iterdir())
    np.testing.assert_array_equal(_logits(session)[-1], _logits(_session(target))[-1])
    shutil.rmtree(target / prepared.CACHE_DIR)
    monkeypatch.setenv(prepared.ENV, "off")
    assert _session(target).graph_cache == ""
    assert not (target / prepared.CACHE_DIR).exists()


@pytest.mark.parametrize("name", ["gemma3", "llama3", "qwen3", "gpt4o", "mistral"])
def test_saved_vocabulary_tables_spell_what_the_tokenizer_does(name: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from test_vocab import TOKENIZERS

    path = tmp_path / "tokenizer.json"
    shutil.copy2(TOKENIZERS[name], path)
    eos = [1, 2]
    fresh = Vocab.from_file(path, eos)
    first = Vocab.from_file(path, eos, cache=tmp_path / "cache")
    assert (tmp_path / "cache" / TABLES_FILE).is_file()

    def no_spelling(*args: object) -> None:
        raise AssertionError("spelled again despite saved tables")

    with monkeypatch.context() as m:
        m.setattr(Tables, "build", no_spelling)
        later = Vocab.from_file(path, eos, cache=tmp_path / "cache")
    for v in (first, later):
        assert v.token_bytes == fresh.token_bytes
        for attr in ("style", "special_ids", "byte_fallback_ids", "single_byte", "adds_prefix_space"):
            assert getattr(v, attr) == getattr(fresh, attr), attr
    # Other EOS ids spell other tables (EOS has no bytes; id 1000 is an ordinary token in each): made
    # again, not read.
    other = Vocab.from_file(path, [1000], cache=tmp_path / "cache")
    assert other.token_bytes == Vocab.from_file(path, [1000]).token_bytes != fresh.token_bytes
