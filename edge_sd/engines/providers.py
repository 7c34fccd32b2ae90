"""Execution providers: which ones this onnxruntime build offers, and the options each one gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort

from edge_sd.errors import ProviderError
from edge_sd.layout import TRT_CACHE_DIR
from edge_sd.manifest import EngineManifest

PROVIDERS = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
# `auto` takes every one of these that this onnxruntime build offers, in this order: the providers
# edge-sd has run its checks through (CUDA on an H200, the CPU on x86-64). TensorRT has never run here
# (its libraries are not on the machines edge-sd is tested on): it is used only when named, with a
# warning (engines/session.py).
AUTO_ORDER = ("cuda", "cpu")
UNVERIFIED = ("tensorrt",)


def available_providers() -> list[str]:
    """Short names of the execution providers this onnxruntime build offers."""
    have = set(ort.get_available_providers())
    return [name for name, full in PROVIDERS.items() if full in have]


def resolve_providers(provider: str, cpu_only: bool = False) -> list[str]:
    """ORT provider names for `auto|cpu|cuda|tensorrt`; an unavailable explicit choice is an error.

    cpu_only: a model-builder graph made for the CPU, which runs there only: `auto` takes the CPU,
    and an accelerator asked for by name is an error. Through the CUDA provider such a graph
    computes wrong logits (a tiny builder pair on an H200: 1,380 of 2,000 sampled pairs outside the
    target's support), its fused attention writing a KV buffer that the provider copies."""
    have = available_providers()
    if provider == "auto":
        return [PROVIDERS["cpu"]] if cpu_only else [PROVIDERS[p] for p in AUTO_ORDER if p in have]
    if provider not in PROVIDERS:
        raise ProviderError(
            f"unknown provider {provider!r}; choose one of auto, {', '.join(PROVIDERS)}"
        )
    if provider not in have:
        raise ProviderError(
            f"provider {provider!r} is not available in this onnxruntime build "
            f"(available: {', '.join(have)}); on a machine with an NVIDIA GPU replace onnxruntime by "
            "onnxruntime-gpu (docs/gpu.md)"
        )
    if cpu_only and provider != "cpu":
        raise ProviderError(
            f"this graph was made for the CPU by the model builder and computes wrong results through "
            f"{provider}; export it with --device cuda for the GPU, or run it with --provider cpu"
        )
    # CUDA backs TensorRT for the nodes TensorRT cannot take (GroupQueryAttention is a contrib op);
    # CPU stays last as the home of any node no accelerator can run.
    chain = {"tensorrt": ["tensorrt", "cuda", "cpu"], "cuda": ["cuda", "cpu"], "cpu": ["cpu"]}[provider]
    return [PROVIDERS[p] for p in chain if p in have or p == provider]


def tensorrt_options(m: EngineManifest, folder: Path, capacity: int, max_rows: int) -> dict[str, Any]:
    """TensorRT EP options: an engine cache in the artifact folder and one shape profile from the manifest.

    capacity: KV positions the engine holds (the shared buffer's size, or the longest concat cache);
    max_rows: the most positions one forward feeds (a prompt's prefill).
    """
    kv = [(m.past_key_template.format(i=i), m.past_value_template.format(i=i)) for i in range(m.num_layers)]

    def shapes(rows: int, total: int, past: int) -> str:
        dims = {"input_ids": f"1x{rows}", "attention_mask": f"1x{total}"}
        if m.has_position_ids:
            dims["position_ids"] = f"1x{rows}"
        for names in kv:
            for name in names:
                dims[name] = f"1x{m.num_kv_heads}x{past}x{m.head_dim}"
        return ",".join(f"{k}:{v}" for k, v in dims.items())

    if m.kv_layout == "shared":  # the buffer never changes size; only the mask grows
        lo, opt, hi = shapes(1, 1, capacity), shapes(1, 64, capacity), shapes(max_rows, capacity, capacity)
    else:
        lo, opt, hi = shapes(1, 1, 0), shapes(1, 64, 63), shapes(max_rows, capacity, capacity - 1)
    return {
        "trt_engine_cache_enable": True,
        "trt_engine_cache_path": str(Path(folder) / TRT_CACHE_DIR),
        "trt_timing_cache_enable": True,
        "trt_fp16_enable": m.kv_dtype == "float16",
        "trt_profile_min_shapes": lo,
        "trt_profile_opt_shapes": opt,
        "trt_profile_max_shapes": hi,
    }


# When worker threads busy-wait for work (OrtSession's `spin`).
SPIN = ("always", "run", "never")


def session_options(threads: int | None, spin: str) -> ort.SessionOptions:
    """ONNX Runtime's options for an engine's session (OrtSession says what `spin` does)."""
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # No arena for host memory: decoding's forwards change size every round (positions fed, positions
    # attended), and an arena keeps every size it was ever asked for, growing through a long
    # generation; plain allocation ran as fast (benchmarks/results/startup.md).
    opts.enable_cpu_mem_arena = False
    # Errors only: ONNX Runtime warns on every load that `logits_to_keep`, an input with a default, is
    # not constant-folded (what edge-sd has to say about providers it says itself).
    opts.log_severity_level = 3
    if spin not in SPIN:
        raise ValueError(f"spin must be one of {', '.join(SPIN)}, not {spin!r}")
    if spin == "run":
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    elif spin == "never":
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts
