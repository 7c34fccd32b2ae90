"""What keeps resident memory near weights plus KV: a regrown cache lets its old tensors go one by one,
large blocks come from mappings of their own (glibc), and a pair's target session is built alone."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

from edge_sd import model as model_module
from edge_sd.engines import host_memory, kv
from edge_sd.engines.ort import OrtEngine

from test_engines import IDS, steps


def test_a_regrown_cache_never_holds_the_old_one_whole(tiny_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the cache doubles, each old tensor is let go once its positions are copied: when the k-th
    new tensor is made, at most all-but-k old ones are alive. The copy stays exact."""
    engine = OrtEngine(tiny_root / "engines" / "bl_llama", provider="cpu", threads=2, capacity=4)
    engine.forward(IDS[:4])
    old = [weakref.ref(a) for a in engine._kv._host]
    alive_at: list[int] = []
    made = kv._mapped_zeros

    def counting(shape: tuple[int, ...], dtype: type) -> tuple[np.ndarray, object]:
        alive_at.append(sum(r() is not None for r in old))
        return made(shape, dtype)

    monkeypatch.setattr(kv, "_mapped_zeros", counting)
    engine.forward(IDS[4:5])  # past 4 positions: the cache regrows
    n = len(old)
    assert engine.capacity > 4 and len(alive_at) == n
    assert all(alive <= n - k for k, alive in enumerate(alive_at)), alive_at
    assert all(r() is None for r in old)
    monkeypatch.setattr(kv, "_mapped_zeros", made)
    np.testing.assert_array_equal(steps(engine, IDS), steps(OrtEngine(engine.shared), IDS))


# A freed 24 MiB block raises glibc's threshold for mapping to 24 MiB; a 12 MiB block allocated after
# it then comes from the heap, unless the threshold was fixed (at 8 MiB). Prints whether it did.
_PROBE = """
import sys
import numpy as np
from edge_sd.engines import host_memory
big = np.ones(24 << 20, dtype=np.uint8)
del big
if sys.argv[1] == "fix":
    assert host_memory.map_large_blocks()
block = np.ones(12 << 20, dtype=np.uint8)
address = block.ctypes.data
with open("/proc/self/maps") as f:
    heap = [line.split()[0].split("-") for line in f if line.rstrip().endswith("[heap]")]
print(any(int(a, 16) <= address < int(b, 16) for a, b in heap))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory.platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
def test_large_blocks_stay_mapped_once_the_threshold_is_fixed() -> None:
    def from_heap(mode: str, **env: str) -> bool:
        out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                             env={"PATH": "", **env})
        return out.stdout.strip() == "True"

    assert from_heap("keep")  # the fault: glibc raised its threshold and took the block from the heap
    assert not from_heap("fix")


# 64 blocks of 1 MiB (under the fixed threshold: from the heap) written and freed, each followed by a
# small block that is kept, so that they are holes inside the heap rather than its free top (which
# free() gives back itself; one kept block after them all is not enough, as malloc may place it in an
# older hole below): their pages stay resident until given back.
# Prints the resident memory (VmRSS, KiB) after freeing and after give_back.
_TRIM_PROBE = """
import ctypes
from edge_sd.engines import host_memory
assert host_memory.map_large_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
blocks, kept = [], []
for _ in range(64):
    blocks.append(libc.malloc(1 << 20))
    kept.append(libc.malloc(4096))
for b in blocks:
    ctypes.memset(b, 1, 1 << 20)
for b in blocks:
    libc.free(b)
freed = rss()
host_memory.give_back()
print(freed, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory.platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc only")
def test_free_heap_pages_are_given_back() -> None:
    out = subprocess.run([sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, check=True)
    freed, after = map(int, out.stdout.split())
    assert freed - after > 48 << 10, (freed, after)  # most of the 64 MiB


def test_a_forward_of_many_positions_gives_the_heap_back(tiny_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's chunk gives the heap's free pages back after it; a step does not pay for it."""
    from edge_sd.engines import engine as engine_module

    calls: list[int] = []
    monkeypatch.setattr(host_memory, "give_back", lambda: calls.append(1))
    engine = OrtEngine(tiny_root / "engines" / "bl_llama", provider="cpu", threads=2)
    engine.forward(np.arange(3, 3 + engine_module.GIVE_BACK_AFTER))
    assert calls == [1]
    engine.truncate(10)
    engine.forward([5])
    engine.reset()
    engine.forward(np.arange(3, 3 + engine_module.GIVE_BACK_AFTER - 1))
    assert calls == [1]


def test_a_threshold_the_environment_sets_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    host_memory.map_large_blocks.cache_clear()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    try:
        assert host_memory.map_large_blocks() is False
    finally:
        host_memory.map_large_blocks.cache_clear()


@pytest.mark.parametrize("defer_drafter", [False, True])
def test_a_pairs_target_session_is_built_while_nothing_else_loads(tiny_root: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   defer_drafter: bool) -> None:
    """Its build is the load's peak of memory: no other session or tokenizer is read beside it (the
    drafter's session built then, or deferred to its first draft)."""
    spans: dict[str, list[float]] = {}
    lock = threading.Lock()

    def timed(name: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                time.sleep(0.05)  # widen each span, so that an overlap cannot slip between two reads
                return fn(*args, **kwargs)
            finally:
                with lock:
                    where = Path(args[0]) if name == "session" else Path(args[0]).parent
                    spans[f"{name} {where.name}"] = [start, time.perf_counter()]
        return run

    monkeypatch.setattr(model_module, "_session", timed("session", model_module._session))
    monkeypatch.setattr(model_module.Vocab, "from_file", timed("vocab", model_module.Vocab.from_file))
    folder = tiny_root / "pairs" / "llama_qwen"
    model = model_module.Model.load(folder, provider="cpu", threads=2, defer_drafter=defer_drafter)
    assert model.drafter is not None and model.drafter.session.loaded is not defer_drafter
    assert set(spans) == {"session target", "session drafter", "vocab target", "vocab drafter"}
    start, end = spans.pop("session target")
    assert all(s >= end for s, _ in spans.values()), spans


def test_a_target_with_its_head_in_parts_is_built_while_its_tokenizer_is_read(
        tiny_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its build holds one part's repacked copy, not the whole head's (export/logits.py): its session
    is built in a thread while the tokenizer is read, and the drafter's tokenizer after that. The
    tiny target's head is small and whole; its manifest is told otherwise, which is all Model.load
    reads."""
    import shutil
    from dataclasses import replace

    from edge_sd.manifest import load_engine_manifest, save

    folder = tmp_path / "pair"
    shutil.copytree(tiny_root / "pairs" / "llama_qwen", folder, ignore=shutil.ignore_patterns("runtime_cache"))
    m = load_engine_manifest(folder / "target")
    save(replace(m, quantization={**(m.quantization or {}), "lm_head_parts": 2}), folder / "target")
    spans: dict[str, list[float]] = {}

    def timed(name: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                time.sleep(0.2)  # longer than the session's head start (model.SESSION_HEAD_START)
                return fn(*args, **kwargs)
            finally:
                where = Path(args[0]) if name == "session" else Path(args[0]).parent
                spans[f"{name} {where.name}"] = [start, time.perf_counter()]
        return run

    monkeypatch.setattr(model_module, "_session", timed("session", model_module._session))
    monkeypatch.setattr(model_module.Vocab, "from_file", timed("vocab", model_module.Vocab.from_file))
    model = model_module.Model.load(folder, provider="cpu", threads=2)
    assert model.drafter is not None and not model.drafter.session.loaded
    session, vocab, drafter = spans["session target"], spans["vocab target"], spans["vocab drafter"]
    assert vocab[0] < session[1] and session[0] < vocab[1], spans  # the two overlap
    assert drafter[0] >= vocab[1], spans
    np.testing.assert_array_equal(model.target.engine.forward([3, 4, 5]),
                                  model_module.Model.load(tiny_root / "pairs" / "llama_qwen", provider="cpu",
                                                          threads=2).target.engine.forward([3, 4, 5]))
