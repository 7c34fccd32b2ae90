"""What a first load leaves beside an engine for later loads (engines/prepared.py, vocab.Tables): the
later loads must compute and spell exactly what a load without it does, and a stale, damaged or
unwritable cache must only cost time."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from edge_sd import scratch
from edge_sd.engines import prepared
from edge_sd.engines.large_pages import Residency
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


@pytest.mark.parametrize("gained", [True, False])
def test_weights_in_small_pages_are_read_again_and_the_session_built_again(
        gained: bool, target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the cache's weights sit mostly in small pages, the session is built again after they are
    read into large ones: it computes what the first did; where that gave no large pages, a marker says
    so and later loads do not try again."""
    first = _session(target)
    data = target / prepared.CACHE_DIR / prepared.ORT_DIR / prepared.DATA
    reads: list[Path] = []
    monkeypatch.setattr(prepared.large_pages, "wanted", lambda d: not (d.parent / prepared.large_pages.MARKER).exists())
    monkeypatch.setattr(prepared.large_pages, "residency", lambda d: Residency(100 << 20, (90 if gained else 1) << 20))
    monkeypatch.setattr(prepared.large_pages, "too_small", lambda d: Residency(100 << 20, 1 << 20)
                        if prepared.large_pages.wanted(d) else None)
    monkeypatch.setattr(prepared.large_pages, "reread", lambda d, spans: reads.append(d) or 0.5)
    again = _session(target)
    assert again.graph_cache == "loaded" and reads == [data]
    assert bool(again.notes) is gained and (not gained or "read again into large pages (0.5 s)" in again.notes[0])
    assert (data.parent / prepared.large_pages.MARKER).exists() is not gained
    for a, b in zip(_logits(first), _logits(again), strict=True):
        np.testing.assert_array_equal(a, b)
    _session(target)
    assert len(reads) == (2 if gained else 1)  # this mock's pages stay small; a marker stops the tries


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


def _overwrite(path: Path, offset: int, length: int) -> None:
    """Random bytes over a stretch of a file, its size unchanged."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.random.default_rng(1).integers(0, 256, length, dtype=np.uint8).tobytes())


@pytest.mark.parametrize("whole", [False, True])
def test_a_cache_overwritten_with_bytes_of_its_size_is_prepared_again(target: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      whole: bool) -> None:
    """Random bytes over the saved weights, the file's size unchanged: the checksum catches them, the
    load says so in a note and prepares the cache again, and the logits are the engine's own. A
    few bytes between the sampled blocks pass a launch's check and are caught by --verify (whole).
    Negative control: the same cache with the check skipped computes other logits."""
    want = _logits(_session(target))
    data = target / prepared.CACHE_DIR / prepared.ORT_DIR / prepared.DATA
    size = data.stat().st_size
    if whole:
        monkeypatch.setattr(prepared, "SAMPLE_BYTES", 64)  # so that the damage falls between the samples
        monkeypatch.setattr(prepared, "SAMPLES", 4)
        assert _session(target).graph_cache == "saved"  # its sampled checksum is another: saved again
    damaged_copy = target.parent / "damaged.data"
    _overwrite(data, size // 3 + 100 if whole else size // 4, 512 if whole else size // 2)
    shutil.copy2(data, damaged_copy)
    if whole:  # a launch's sampled check does not reach them; every byte's does
        from edge_sd.manifest import load_engine_manifest

        key = prepared.cache_key(load_engine_manifest(target), target)
        assert prepared.saved_model(target, key) == (data.parent / prepared.MODEL, "")
        assert prepared.saved_model(target, key, whole=True) == (None, f"{prepared.DATA} failed its checksum")
    again = OrtSession(target, provider="cpu", threads=2, verify_files=whole)
    assert again.graph_cache == "saved" and "runtime cache was damaged" in again.notes[0], again.notes
    for a, b in zip(want, _logits(again), strict=True):
        np.testing.assert_array_equal(a, b)
    if whole:
        return
    # negative control: the damaged weights, used as they are, give other logits
    shutil.copy2(damaged_copy, data)
    monkeypatch.setattr(prepared, "digest", lambda path, whole: json.loads(
        (path.parent / prepared.KEY_FILE).read_text())["checksums"][path.name]["whole" if whole else "sampled"])
    blind = _session(target)
    assert blind.graph_cache == "loaded"
    assert any(not np.array_equal(a, b) for a, b in zip(want, _logits(blind), strict=True))


def test_a_killed_first_loads_leftovers_are_removed(target: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A first load killed while saving leaves its temporary folder (up to a GB): the next load that
    saves removes those of processes that no longer run, and leaves a running one's alone."""
    import subprocess

    cache = target / prepared.CACHE_DIR
    cache.mkdir()
    ended = subprocess.Popen(["true"])
    ended.wait()  # a pid that ran and ended
    orphan = cache / f".{prepared.ORT_DIR}-{ended.pid}-x1y2"
    orphan.mkdir()
    (orphan / prepared.DATA).write_bytes(b"half written")
    alive = cache / f".{prepared.ORT_DIR}-1-zz"  # pid 1 runs
    alive.mkdir()
    # named before folders carried a pid: removed once old enough to belong to no running load
    unnamed_old, unnamed_new = cache / f".{prepared.ORT_DIR}-k3j9x0aa", cache / f".{prepared.ORT_DIR}-q8w7e6rr"
    unnamed_old.mkdir()
    unnamed_new.mkdir()
    long_ago = time.time() - scratch.UNNAMED_AGE_S - 60
    os.utime(unnamed_old, (long_ago, long_ago))
    with caplog.at_level(logging.INFO, logger="edge_sd"):
        assert _session(target).graph_cache == "saved"
    assert not orphan.exists() and not unnamed_old.exists() and alive.exists()
    assert {p.name for p in cache.iterdir()} == {alive.name, unnamed_new.name, prepared.ORT_DIR}
    # each removal is named, with what it held
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2 and any(str(orphan) in n and f"process {ended.pid}" in n for n in notes)
    assert any(str(unnamed_old) in n for n in notes)


def test_damaged_vocabulary_tables_are_spelled_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Truncated, or random bytes of the same size (zip's CRC checks each member): read as missing,
    spelled again and saved over."""
    from test_vocab import TOKENIZERS

    path = tmp_path / "tokenizer.json"
    shutil.copy2(TOKENIZERS["qwen3"], path)
    fresh = Vocab.from_file(path, [1])
    tables = tmp_path / "cache" / TABLES_FILE
    Vocab.from_file(path, [1], cache=tmp_path / "cache")
    size = tables.stat().st_size
    for damage in ("truncate", "overwrite"):
        if damage == "truncate":
            tables.write_bytes(tables.read_bytes()[: size // 2])
        else:
            _overwrite(tables, size // 3, size // 3)
        again = Vocab.from_file(path, [1], cache=tmp_path / "cache")
        assert again.token_bytes == fresh.token_bytes
        with monkeypatch.context() as m:  # saved over, whole: the next load reads it
            m.setattr(Tables, "build", lambda *a: pytest.fail("spelled again despite tables saved over"))
            assert Vocab.from_file(path, [1], cache=tmp_path / "cache").token_bytes == fresh.token_bytes


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
