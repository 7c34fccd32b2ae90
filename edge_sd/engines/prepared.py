"""What an engine's first load on a machine prepares for the later ones: ONNX Runtime's optimized graph
with its prepacked weights, saved beside the engine (`runtime_cache/ort/`) and mapped from there.

Building a CPU session optimizes the graph and repacks every quantized weight into its kernel's
layout, on every launch, and keeps the repacked copies on the heap: a tied embedding (one table that
the embedding lookup reads as it is and the LM head reads repacked) is then held twice. A session
loaded from the saved graph skips the optimizing, and the operating system maps both copies from the
file, so only the pages forwards touch are resident (the lookup touches a few rows of its table).

The saved graph is what ONNX Runtime itself built from the engine, so it computes the same logits bit
for bit (tests/test_prepared.py). It is used only where it was made: the key (key.json) names the
engine's files, the ONNX Runtime version and the CPU, and any change prepares it again. Set
EDGE_SD_RUNTIME_CACHE=0 to neither read nor write it (a read-only folder is skipped silently).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

import onnxruntime as ort

from edge_sd.manifest import EngineManifest

CACHE_DIR = "runtime_cache"
ORT_DIR = "ort"
KEY_FILE = "key.json"
MODEL = "model.onnx"
DATA = "model.onnx.data"
FORMAT = 1
# Engines smaller than this build their sessions in a fraction of a second and hold little twice:
# saving them would cost a launch more than it saves.
MIN_BYTES = 16 << 20
ENV = "EDGE_SD_RUNTIME_CACHE"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def cpu_identity() -> str:
    """The CPU's model and instruction-set flags: prepacked layouts follow the kernels MLAS picks for
    them, so a saved graph is good only on the same kind of CPU."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "Features", "CPU implementer", "CPU part") and name not in fields:
                    fields[name] = value.strip()
                if not line.strip() and fields:
                    break  # the first processor's block is enough
    except OSError:
        pass
    text = json.dumps([platform.machine(), platform.processor(), fields], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_files(m: EngineManifest) -> list:
    """The manifest's entries for the graph and its external data."""
    return [entry for entry in m.files if entry.path.startswith(m.model_file)]


def cache_key(m: EngineManifest, folder: Path) -> dict:
    """What the saved graph was made from; any difference makes it stale."""
    files = []
    for entry in _model_files(m):
        stat = (Path(folder) / entry.path).stat()
        files.append([entry.path, stat.st_size, stat.st_mtime_ns, entry.sha256])
    return {"format": FORMAT, "onnxruntime": ort.__version__, "cpu": cpu_identity(), "files": files}


def wanted(m: EngineManifest, providers: list[str]) -> bool:
    """Whether this engine's loads go through the cache: the CPU provider alone (a graph saved for an
    accelerator holds nodes compiled for it), weights large enough to pay, and not switched off."""
    weights = sum(f.bytes for f in _model_files(m))
    return enabled() and providers == ["CPUExecutionProvider"] and weights >= MIN_BYTES


def saved_model(folder: Path, key: dict) -> Path | None:
    """The saved graph beside the engine, if it was made from what `key` describes."""
    where = Path(folder) / CACHE_DIR / ORT_DIR
    try:
        ok = json.loads((where / KEY_FILE).read_text(encoding="utf-8")) == key
    except (OSError, ValueError):
        return None
    return where / MODEL if ok and (where / MODEL).is_file() and (where / DATA).is_file() else None


def save_to(opts: ort.SessionOptions, folder: Path) -> Path | None:
    """Ask the session these options build to save its optimized graph (prepacked weights in its data
    file) into a new folder beside the engine, returned (None where the engine's folder is not
    writable); `commit` moves it into place once the session is built."""
    parent = Path(folder) / CACHE_DIR
    try:
        parent.mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{ORT_DIR}-", dir=parent))
        tmp.chmod(0o755)  # mkdtemp's folder is its owner's only; the engine's folder is not
    except OSError:
        return None
    opts.optimized_model_filepath = str(tmp / MODEL)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA)
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    opts.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    return tmp


def commit(tmp: Path, folder: Path, key: dict) -> None:
    """Move a saved graph into place (whole or not at all); on any failure leave no trace of it."""
    final = Path(folder) / CACHE_DIR / ORT_DIR
    try:
        if not (tmp / MODEL).is_file() or not (tmp / DATA).is_file():
            raise OSError("ONNX Runtime saved no graph")
        (tmp / KEY_FILE).write_text(json.dumps(key) + "\n", encoding="utf-8")
        if final.exists():
            old = final.with_name(f".{ORT_DIR}-old-{os.getpid()}")
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
    except OSError:
        discard(tmp)


def size(folder: Path) -> int | None:
    """Bytes an engine's runtime cache takes on disk (None: it has none)."""
    where = Path(folder) / CACHE_DIR
    if not where.is_dir():
        return None
    return sum(f.stat().st_size for f in where.rglob("*") if f.is_file())


def discard(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
