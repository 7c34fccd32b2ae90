"""The artifact contract: `engine.json` (one per engine folder) and `pair.json` (one per pair folder).

Everything a host needs to drive an exported model without Python lives here; README.md documents the
fields for C# and C++ hosts. Both files are validated on load: a missing field, a wrong type or an
unknown format version is an ArtifactError naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_sd.errors import ArtifactError
from edge_sd.layout import ENGINE_FILE, PAIR_FILE

# Bumped whenever a field changes meaning; readers refuse versions they do not know. Version 2 added
# `kv_layout` and `min_step_positions`: a version-1 reader would drive a shared-buffer graph wrongly.
# Version 3 added `grouped_attention`, whose graphs take inputs a version-2 reader does not bind.
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # version 1 files are concat-layout engines, one position per step
# gguf: a GGUF file's own quantized weights, exactly (export/gguf_graph.py).
PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")
# How the KV cache is passed (README, "The manifest contract"):
#   concat: `present` = past + new positions, a fresh tensor each call (optimum's exports);
#   shared: one buffer per layer, bound as both past and present; a call writes only its new
#           positions and `attention_mask`'s length says how many are valid (GroupQueryAttention).
KV_LAYOUTS = ("concat", "shared")
# An optional int64 input of shape [1] (default 0: every position): the graph computes logits for the
# last n positions only (export/logits.py); an engine without it returns logits for every position fed.
KEEP_INPUT = "logits_to_keep"
# The offset from which sliding-window layers read their cache (manifest `window_views`): an int64
# scalar input with a default of 0, so a host that does not bind it runs as if there were no views.
WINDOW_INPUT = "window_offset"
# The same for the global layers computed over the whole cache in one product (manifest
# `grouped_attention`): their GroupQueryAttention nodes, which only write the new positions, count
# the cache from this offset; the product reads `whole.<past input name>`.
GLOBAL_INPUT = "global_offset"
WHOLE_PREFIX = "whole."


@dataclass(frozen=True)
class FileEntry:
    """One file of an artifact folder, with what is needed to check it."""

    path: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class EngineManifest:
    """Everything needed to drive one exported decoder (see README, "The manifest contract")."""

    format_version: int
    name: str
    architecture: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    kv_dtype: str
    precision: str
    logits_width: int
    vocab_size: int
    bos_token_id: int | None
    add_bos: bool
    eos_token_ids: list[int]
    pad_token_id: int | None
    has_position_ids: bool
    max_context: int
    sliding_window: int | None
    model_file: str
    tokenizer_file: str
    input_names: list[str]
    output_names: list[str]
    past_key_template: str = "past_key_values.{i}.key"
    past_value_template: str = "past_key_values.{i}.value"
    present_key_template: str = "present.{i}.key"
    present_value_template: str = "present.{i}.value"
    chat_template: str | None = None
    source: str = ""
    kv_layout: str = "concat"
    # Forwards over fewer positions take other kernels on some CPUs (a single row goes through a GEMV
    # path): feeding at least this many (re-feeding cached ones) keeps every forward on one kernel, so
    # that a k-token verification computes exactly what single steps compute. Measured at export.
    min_step_positions: int = 1
    # Rows the LM head computes at least, where that is fewer than min_step_positions: 1 where the
    # head's kernel gives a single row exactly what it gives that row among several (8-bit weights)
    # while the layers need two. None: min_step_positions. Measured at export.
    min_head_rows: int | None = None
    # Each GroupQueryAttention also reads the position before the forward's first back from the KV
    # cache and attends over it too (export/attention_steps.py), so that a one-position step runs the
    # same attention kernel as a verification forward. Forwards still split at multiples of 64
    # (engines/consistency.py, SPLIT_AT), without re-feeding.
    previous_row_attention: bool = False
    # Sliding-window layers that may read their cache through a view from an offset (input
    # `window_offset`, export/attention_steps.py): {"layers": [...], "window": W, "granule": G}. The
    # offset of a forward whose first new position is p is the largest multiple of G at most p - W - 1
    # (0 below); G is measured at export, the smallest tried at which views compute bit for bit what
    # the whole cache does (0: views off). Empty: no such layers.
    window_views: dict[str, Any] = field(default_factory=dict)
    # Global layers of one key/value head whose attention is one product over all heads
    # (export/grouped_attention.py): the graph takes `global_offset` and `whole.<past input>` for each.
    grouped_attention: list[int] = field(default_factory=list)
    export_path: str = "optimum"
    # What the graph was made for: "cpu", or "cuda" (the model builder's --device cuda graphs). The
    # builder makes a graph for one device: its fused attention writes the KV cache in place, and a
    # CPU graph run through the CUDA provider computes wrong logits (engines/providers.py).
    device: str = "cpu"
    exporter: dict[str, str] = field(default_factory=dict)
    # A drafter whose LM head keeps only some rows (export --drafter-vocab-keep): an .npy file of int64
    # drafter ids, one per logits column, ascending. None: column i is token id i.
    kept_ids_file: str | None = None
    files: list[FileEntry] = field(default_factory=list)
    validation: dict[str, Any] = field(default_factory=dict)
    # How the weights were quantized, where the export did more than name a precision: for gguf, the
    # weights carried from the file by GGML type and how they were checked (export/gguf_graph.py); for
    # gguf and fp32 targets, how many parts the LM head is computed in (export/logits.py).
    quantization: dict[str, Any] = field(default_factory=dict)
    # An 8-bit LM head (blocks of 32, no zero points) that the runtime may compute itself
    # (engines/lm_head.py): {"output": the graph output holding the hidden states the head reads,
    # "rows", "cols", "file": the weights file, "weight": [offset, bytes] of its blocks [rows, cols]
    # (each weight + 128), "scales": [offset, bytes] of its float32 scales [rows, cols / 32], each a
    # value a float16 holds}. The graph still computes the head for apps that read `logits`. Empty:
    # none.
    lm_head: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_bytes_per_position(self) -> int:
        """What one cached position takes: a key and a value per layer. The shared layout commits
        pages only as positions are written, so a cache of n positions holds about n times this."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (2 if self.kv_dtype == "float16" else 4)

    @property
    def scored_ids(self) -> int:
        """How many token ids have both a logit and a token: logits may be wider than the tokenizer (a
        padded LM head) or narrower (Gemma 3's tokenizer has one token more than its head)."""
        return min(self.logits_width, self.vocab_size)


@dataclass(frozen=True)
class PairManifest:
    """A target and a drafter folder side by side, plus the precomputed vocabulary maps."""

    format_version: int
    name: str
    target: str
    drafter: str
    same_vocabulary: bool
    maps_file: str | None
    target_tokenizer_sha256: str
    drafter_tokenizer_sha256: str
    stats: dict[str, Any] = field(default_factory=dict)
    # RDK's kernel M (export --drafter-vocab-keep): an .npz of rows (drafter ids), cols (target ids) and
    # vals, a sparse row-stochastic matrix in coordinate form.
    rdk_file: str | None = None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks so that multi-GB weights do not fill memory."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entries(folder: Path, exclude: tuple[str, ...] = (ENGINE_FILE,)) -> list[FileEntry]:
    """Checksum every file of a folder (sorted, relative paths)."""
    entries = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in exclude:
            entries.append(FileEntry(rel, p.stat().st_size, sha256_file(p)))
    return entries


def _from_dict(cls: type, data: Any, source: Path) -> Any:
    if not isinstance(data, dict):
        raise ArtifactError(f"{source}: expected a JSON object, got {type(data).__name__}")
    version = data.get("format_version")
    if version not in READABLE_VERSIONS:
        raise ArtifactError(
            f"{source}: format_version {version!r} is not supported by this edge-sd "
            f"(it reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-export the model or upgrade edge-sd"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ArtifactError(f"{source}: required field {f.name!r} is missing")
            continue
        kwargs[f.name] = data[f.name]
    if cls is EngineManifest and "device" not in data:  # written before the field: CUDA graphs were fp16
        kwargs["device"] = "cuda" if data.get("kv_dtype") == "float16" else "cpu"
    if cls is EngineManifest:
        try:
            kwargs["files"] = [FileEntry(**e) for e in kwargs.get("files", [])]
        except TypeError as e:
            raise ArtifactError(f"{source}: bad 'files' entry: {e}") from None
    obj = cls(**kwargs)
    _check_types(obj, source)
    return obj


def _check_types(obj: Any, source: Path) -> None:
    # A light check of the scalar fields: enough to turn a hand-edited manifest into a clear message.
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        expected = {"int": int, "str": str, "bool": bool}.get(str(f.type))
        if expected is not None and (not isinstance(value, expected) or
                                     (expected is int and isinstance(value, bool))):
            raise ArtifactError(f"{source}: field {f.name!r} should be {f.type}, got {value!r}")
    if isinstance(obj, EngineManifest):
        if obj.precision not in PRECISIONS:
            raise ArtifactError(f"{source}: unknown precision {obj.precision!r}")
        if obj.kv_layout not in KV_LAYOUTS:
            raise ArtifactError(f"{source}: unknown kv_layout {obj.kv_layout!r} (expected one of {KV_LAYOUTS})")
        if obj.min_step_positions < 1:
            raise ArtifactError(f"{source}: min_step_positions must be at least 1, got {obj.min_step_positions}")
        if obj.min_head_rows is not None and (type(obj.min_head_rows) is not int or obj.min_head_rows < 1):
            raise ArtifactError(f"{source}: min_head_rows must be null or at least 1, got {obj.min_head_rows!r}")
        head = obj.lm_head
        if head and not (isinstance(head, dict) and {"output", "rows", "cols", "file", "weight", "scales"} <= set(head)
                         and all(isinstance(head[k], list) and len(head[k]) == 2 and
                                 all(type(v) is int and v >= 0 for v in head[k]) for k in ("weight", "scales"))
                         and all(type(head[k]) is int and head[k] > 0 for k in ("rows", "cols"))):
            raise ArtifactError(f"{source}: lm_head is not a description of an 8-bit head: {head!r}")


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise ArtifactError(f"{path} not found: is this an edge-sd artifact folder?")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e})") from None


def export_kind(folder: Path) -> str:
    """"pair" or "engine": what `edge-sd export` wrote into `folder`; ArtifactError for anything else,
    which every command checks before it loads or downloads anything."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder (expected an edge-sd export)")
    if (folder / PAIR_FILE).is_file():
        return "pair"
    if (folder / ENGINE_FILE).is_file():
        return "engine"
    raise ArtifactError(f"{folder} has neither {PAIR_FILE} nor {ENGINE_FILE}: not an edge-sd export")


def load_engine_manifest(folder: Path) -> EngineManifest:
    path = Path(folder) / ENGINE_FILE
    return _from_dict(EngineManifest, _load_json(path), path)


def load_pair_manifest(folder: Path) -> PairManifest:
    path = Path(folder) / PAIR_FILE
    return _from_dict(PairManifest, _load_json(path), path)


def save(obj: EngineManifest | PairManifest, folder: Path) -> Path:
    name = ENGINE_FILE if isinstance(obj, EngineManifest) else PAIR_FILE
    return write_aside(Path(folder) / name, json.dumps(dataclasses.asdict(obj), indent=2, ensure_ascii=False) + "\n")


def write_aside(path: Path, text: str) -> Path:
    """Write a folder's small text file aside and rename it over `path`: a reader never sees half a
    file, and a folder whose files are hard links to another's (a copied pair) gets its own file
    instead of rewriting the other's. The temporary name is the process's own, so that two processes
    writing the same file at once each rename a whole one over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_files(manifest: EngineManifest, folder: Path, full: bool = False) -> None:
    """Check that the files listed in a manifest are there with the right size (and hash if `full`)."""
    for entry in manifest.files:
        p = Path(folder) / entry.path
        if not p.is_file():
            raise ArtifactError(f"{p} is missing (listed in {ENGINE_FILE})")
        size = p.stat().st_size
        if size != entry.bytes:
            raise ArtifactError(
                f"{p} is {size} bytes but the manifest says {entry.bytes}: the file is corrupted "
                "or was replaced; re-export"
            )
        if full and sha256_file(p) != entry.sha256:
            raise ArtifactError(f"{p}: sha256 does not match the manifest: the file is corrupted")
