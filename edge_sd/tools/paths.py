"""Where edge-sd keeps what it downloads or builds between runs (prompt sets, corpora, exported pairs,
llama.cpp builds): $EDGE_SD_CACHE, by default ~/.cache/edge-sd. The one place that knows it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("EDGE_SD_CACHE") or Path.home() / ".cache" / "edge-sd")
