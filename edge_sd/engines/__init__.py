"""Engines run one exported decoder with a KV cache (ONNX Runtime, two KV layouts)."""

from edge_sd.engines.base import Engine
from edge_sd.engines.ort import OrtEngine
from edge_sd.engines.providers import available_providers, resolve_providers

__all__ = ["Engine", "OrtEngine", "available_providers", "resolve_providers"]
