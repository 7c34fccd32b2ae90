"""Where edge-sd keeps what it downloads or builds between runs: `cache_dir`, defined beside the
runtime's other names of places (edge_sd/layout.py) and imported from here by the tools."""

from __future__ import annotations

from edge_sd.layout import cache_dir

__all__ = ["cache_dir"]
