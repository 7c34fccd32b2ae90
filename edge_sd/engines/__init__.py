"""Engines run one exported decoder with a KV cache; `load_engine` picks the implementation."""

from edge_sd.engines.base import Engine
from edge_sd.engines.ort import OrtEngine, available_providers, resolve_providers

__all__ = ["Engine", "OrtEngine", "available_providers", "resolve_providers"]
