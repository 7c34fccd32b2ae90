"""The names of the files and folders in an artifact folder (docs/artifact-format.md), in one place:
the exporter writes them, the runtime reads them, and a host in another language finds them there.

A pair folder holds `pair.json`, the vocabulary maps and the optional fitted files beside a target
and a drafter engine folder; an engine folder holds `engine.json`, the ONNX files and the tokenizer,
and the runtime cache it writes on first load. Also here: where edge-sd keeps its own cache outside
any artifact folder (`cache_dir`).
"""

import os
from pathlib import Path

ENGINE_FILE = "engine.json"  # an engine's manifest
PAIR_FILE = "pair.json"  # a pair's manifest
TOKENIZER_FILE = "tokenizer.json"  # the engine's tokenizer (Hugging Face tokenizers format)
TARGET_DIR, DRAFTER_DIR = "target", "drafter"  # a pair's engine folders as the exporter names them
MAPS_FILE = "maps.npz"  # TLI's intersection and SLRS's prefix map
COSTS_FILE = "costs.json"  # the engines' measured costs (export, `edge-sd calibrate`)
DISCO_FILE = "disco.json"  # DISCO's classifier (`edge-sd calibrate`)
KEPT_FILE = "kept_ids.npy"  # a pruned drafter head's drafter ids
KERNEL_FILE = "rdk.npz"  # RDK's kernel

# What the runtime writes into an engine folder on its first load (rebuilt whenever it does not check out)
CACHE_DIR = "runtime_cache"
ORT_DIR = "ort"  # ONNX Runtime's optimized graph: MODEL and DATA, with KEY_FILE
KEY_FILE = "key.json"  # what the graph was built from, and its checksums
MODEL = "model.onnx"
DATA = "model.onnx.data"
TABLES_FILE = "vocab_tables.npz"  # every token's bytes
QUICK_FILE = "tokenizer.json"  # the tokenizer with its merges as strings, for a quicker read
QUICK_PARTS = "tokenizer_parts.npz"  # or its vocabulary and merges as arrays, where strings cannot hold them
QUICK_KEY = "tokenizer_key.json"  # which of the two, and the tokenizer file it was made from
TRT_CACHE_DIR = "trt_cache"  # TensorRT's engine cache (GPU only)


def cache_dir() -> Path:
    """Where edge-sd keeps what it downloads or builds between runs, outside any artifact folder
    (prompt sets, corpora, exported pairs, llama.cpp builds, the LM head's compiled kernel):
    $EDGE_SD_CACHE, by default ~/.cache/edge-sd. The one place that knows it."""
    return Path(os.environ.get("EDGE_SD_CACHE") or Path.home() / ".cache" / "edge-sd")
