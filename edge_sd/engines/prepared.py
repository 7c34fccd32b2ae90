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

A cache that lies would give wrong text that looks right (a weights file overwritten with other bytes
of the same size ran, and gave token 0 over and over), so key.json also holds each file's checksum,
checked before the graph is used: a mismatch prepares it again. A launch checks the graph whole and
samples blocks of the weights file (SAMPLES blocks spread over it, with its size): hashing all of a
270M model's weights would add a large share of a later launch, while a damaged stretch of any
length reaches a sampled block sooner or later. `--verify` (check_files) hashes every byte.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

import onnxruntime as ort

from edge_sd.engines import attention, large_pages
from edge_sd.errors import ArtifactError
from edge_sd.layout import CACHE_DIR, DATA, KEY_FILE, MODEL, ORT_DIR
from edge_sd.manifest import EngineManifest
from edge_sd.scratch import scratch_folder

FORMAT = 2  # 2: key.json holds the files' checksums
# Engines smaller than this build their sessions in a fraction of a second and hold little twice:
# saving them would cost a launch more than it saves.
MIN_BYTES = 16 << 20
ENV = "EDGE_SD_RUNTIME_CACHE"
# A launch's check of the weights file: this many blocks of SAMPLE_BYTES, evenly spread, and its last.
SAMPLES = 256
SAMPLE_BYTES = 16 << 10


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
    """What the saved graph was made from (on the CPU provider, as it is only made); any difference
    makes it stale."""
    files = []
    for entry in _model_files(m):
        stat = (Path(folder) / entry.path).stat()
        files.append([entry.path, stat.st_size, stat.st_mtime_ns, entry.sha256])
    # The attention kernel's nodes are in the saved graph where it was made with the kernel.
    kernel = attention_kernel(m, ["CPUExecutionProvider"])
    return {"format": FORMAT, "onnxruntime": ort.__version__, "cpu": cpu_identity(), "files": files,
            "attention": attention.identity(kernel) if kernel else None}


def wanted(m: EngineManifest, providers: list[str]) -> bool:
    """Whether this engine's loads go through the cache: the CPU provider alone (a graph saved for an
    accelerator holds nodes compiled for it), weights large enough to pay, and not switched off."""
    weights = sum(f.bytes for f in _model_files(m))
    return enabled() and providers == ["CPUExecutionProvider"] and weights >= MIN_BYTES


def digest(path: Path, whole: bool) -> str:
    """A checksum of a file: of every byte, or (whole False, a file larger than the samples) of its
    size and SAMPLES blocks spread evenly over it and its last block."""
    h = hashlib.sha256()  # faster than BLAKE2b on CPUs with SHA instructions (x86 SHA-NI, Arm SHA2)
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if whole or size <= 2 * SAMPLES * SAMPLE_BYTES:
            for chunk in iter(lambda: f.read(8 << 20), b""):
                h.update(chunk)
        else:
            for offset in [i * (size // SAMPLES) for i in range(SAMPLES)] + [size - SAMPLE_BYTES]:
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def checksums(where: Path) -> dict:
    """The saved graph's files' checksums, as key.json keeps them: sampled and whole."""
    return {name: {"sampled": digest(where / name, whole=False), "whole": digest(where / name, whole=True)}
            for name in (MODEL, DATA)}


def saved_model(folder: Path, key: dict, whole: bool = False) -> tuple[Path | None, str]:
    """The saved graph beside the engine, if it was made from what `key` describes and its files match
    their checksums (whole: every byte hashed, else sampled); and why not, where there is one that
    does not ("" where there is none, or it is stale)."""
    where = Path(folder) / CACHE_DIR / ORT_DIR
    try:
        saved = json.loads((where / KEY_FILE).read_text(encoding="utf-8"))
        sums = saved.pop("checksums", None)
    except (OSError, ValueError, AttributeError):
        return None, "unreadable" if where.is_dir() else ""
    if saved != key:  # stale (an older format's included): prepared again, nothing to report
        return None, ""
    kind = "whole" if whole else "sampled"
    try:
        bad = [name for name in (MODEL, DATA) if digest(where / name, whole) != sums[name][kind]]
    except (OSError, KeyError, TypeError):
        return None, "unreadable"
    return (None, f"{', '.join(bad)} failed its checksum") if bad else (where / MODEL, "")


def save_to(opts: ort.SessionOptions, folder: Path) -> Path | None:
    """Ask the session these options build to save its optimized graph (prepacked weights in its data
    file) into a new folder beside the engine, returned (None where the engine's folder is not
    writable); `commit` moves it into place once the session is built."""
    parent = Path(folder) / CACHE_DIR
    try:
        parent.mkdir(exist_ok=True)
        tmp = scratch_folder(parent, f".{ORT_DIR}-")  # a killed first load's is removed here
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
        (tmp / KEY_FILE).write_text(json.dumps({**key, "checksums": checksums(tmp)}) + "\n", encoding="utf-8")
        if final.exists():
            old = final.with_name(f".{ORT_DIR}-{os.getpid()}-old")
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


def build(m: EngineManifest, folder: Path, opts: ort.SessionOptions, chosen: list, names: list[str], whole: bool,
          notes: list[str]) -> tuple[ort.InferenceSession, str, bool]:
    """An engine's session, from the graph a first load saved beside it where there is one, else from
    the engine, saving it for the next load. Also says which: "loaded" / "saved" from or into that
    cache, "" neither; and whether edge-sd's kernel computes every attention of the graph
    (attention.rewrite). whole: check every byte of the cache (else sampled blocks); notes: where a
    damaged cache is reported."""
    where = (folder / m.model_file).parent
    rewritten, everywhere = _with_kernel(m, folder, opts, names)
    # The engine's graph, with edge-sd's attention nodes where the kernel runs.
    original = rewritten if rewritten is not None else folder / m.model_file

    if not wanted(m, names):
        return open_session(original, opts, chosen, where), "", everywhere
    key = cache_key(m, folder)
    saved, damaged = saved_model(folder, key, whole=whole)
    if damaged:
        notes.append(f"{m.name}: its runtime cache was damaged ({damaged}); prepared again")
    if saved is not None:
        level = opts.graph_optimization_level
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized already
        try:
            session = ort.InferenceSession(str(saved), sess_options=opts, providers=chosen)
        except Exception:  # damaged: made again below
            notes.append(f"{m.name}: ONNX Runtime could not load its runtime cache; prepared again")
            discard(saved.parent)
            opts.graph_optimization_level = level
        else:
            small = large_pages.too_small(saved.parent / DATA)
            if small is not None:
                del session  # its mappings go: pages no one maps leave the page cache
                session = _in_large_pages(m, saved, small, opts, chosen, notes)
            return session, "loaded", everywhere
    tmp = save_to(opts, folder)
    if tmp is None:
        return open_session(original, opts, chosen, where), "", everywhere
    try:
        session = open_session(original, opts, chosen, where)
    except ArtifactError:
        # ONNX Runtime fails the whole load when it cannot write the graph (a full disk, say): loaded
        # again without saving, it reports what is wrong with the engine itself, if anything.
        discard(tmp)
        opts.optimized_model_filepath = ""
        return open_session(original, opts, chosen, where), "", everywhere
    except BaseException:
        discard(tmp)
        raise
    commit(tmp, folder, key)
    return session, "saved", everywhere


def _with_kernel(m: EngineManifest, folder: Path, opts: ort.SessionOptions,
                 names: list[str]) -> tuple[bytes | None, bool]:
    """Where edge-sd's attention kernel runs: its library registered in `opts` (before either graph
    loads: the saved one holds its nodes), the engine's graph rewritten for it (None where no node
    is), and whether it computes every attention of the graph (attention.rewrite)."""
    kernel = attention_kernel(m, names)
    if kernel is None:
        return None, False
    opts.register_custom_ops_library(str(kernel))
    try:
        graph, count, everywhere = attention.rewrite((folder / m.model_file).read_bytes(), m.head_dim, m.kv_dtype)
    except (OSError, ValueError, IndexError):  # unreadable, or not a protobuf message: ONNX Runtime says
        return None, False
    return (graph, everywhere) if count else (None, False)


def _in_large_pages(m: EngineManifest, saved: Path, small: large_pages.Residency, opts: ort.SessionOptions,
                    chosen: list, notes: list[str]) -> ort.InferenceSession:
    """The saved graph's session, built again after its weights file is read into large pages, the page
    cache having held it in small ones (engines/large_pages.py)."""
    data = saved.parent / DATA
    took = large_pages.reread(data, small.spans)
    session = ort.InferenceSession(str(saved), sess_options=opts, providers=chosen)
    after = large_pages.residency(data)
    if after is None or after.share < large_pages.SMALL:
        large_pages.mark_of_no_use(data, small, after)
    else:
        notes.append(f"{m.name}: its runtime cache was read again into large pages ({took:.1f} s): the page "
                     "cache held it in small ones, in which its forwards run slower")
    return session


def attention_kernel(m: EngineManifest, names: list[str]) -> Path | None:
    """The attention kernel's library an engine's session registers (engines/attention.py): on the CPU
    provider alone, for a graph whose caches are shared buffers (past and present bound to one), where
    the kernel is wanted and built."""
    if names != ["CPUExecutionProvider"] or m.kv_layout != "shared":
        return None
    return attention.wanted()[0]


def open_session(path: Path | bytes, opts: ort.SessionOptions, chosen: list,
                 folder: Path | None = None) -> ort.InferenceSession:
    """A session of the graph at `path`, or of a serialized graph whose weights lie in `folder`."""
    if isinstance(path, bytes):
        # Set here, not before: a graph read from a file finds its weights beside it (the saved one's).
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    try:
        return ort.InferenceSession(path if isinstance(path, bytes) else str(path), sess_options=opts,
                                    providers=chosen)
    except Exception as e:  # ORT raises its own exception types for unreadable models
        text = str(e).strip()
        first = text.splitlines()[0][:300] if text else type(e).__name__
        where = "the engine's graph with edge-sd's attention" if isinstance(path, bytes) else path
        raise ArtifactError(f"{where}: ONNX Runtime could not load it ({first})") from None
