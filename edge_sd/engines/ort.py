"""ONNX Runtime engine: IO binding, KV cache kept as OrtValues between steps."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_sd.errors import ArtifactError, ContextLimitError, ProviderError
from edge_sd.manifest import EngineManifest, check_files, load_engine_manifest

PROVIDERS = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
# `auto` tries these in order and takes every one that this onnxruntime build offers.
AUTO_ORDER = ("tensorrt", "cuda", "cpu")
_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def available_providers() -> list[str]:
    """Short names of the execution providers this onnxruntime build offers."""
    have = set(ort.get_available_providers())
    return [name for name, full in PROVIDERS.items() if full in have]


def resolve_providers(provider: str) -> list[str]:
    """ORT provider names for `auto|cpu|cuda|tensorrt`; an unavailable explicit choice is an error."""
    have = available_providers()
    if provider == "auto":
        return [PROVIDERS[p] for p in AUTO_ORDER if p in have]
    if provider not in PROVIDERS:
        raise ProviderError(
            f"unknown provider {provider!r}; choose one of auto, {', '.join(PROVIDERS)}"
        )
    if provider not in have:
        raise ProviderError(
            f"provider {provider!r} is not available in this onnxruntime build "
            f"(available: {', '.join(have)}); install edge-sd[gpu] on a machine with a GPU"
        )
    # CPU stays last as the home of any node the accelerator cannot run.
    return [PROVIDERS[provider]] + ([PROVIDERS["cpu"]] if provider != "cpu" else [])


class OrtEngine:
    """One exported decoder driven through ONNX Runtime IO binding.

    The KV cache lives in the `present.*` OrtValues of the last call and is bound straight back as
    `past_key_values.*`, so no cache crosses into numpy per step. Cutting the cache back (after a
    rejected draft) is the only copy, and only of the positions that are kept.
    """

    def __init__(
        self,
        folder: Path,
        provider: str = "auto",
        threads: int | None = None,
        verify_files: bool = False,
        spin: bool = True,
    ):
        """spin: let ONNX Runtime's worker threads spin between runs. Faster for one engine alone
        (Gemma-3-270M, 2 cores: 55.5 against 60 ms/token); for a target and a drafter that take
        turns it is slower, since one session's spinning threads steal the cores the other runs on
        (SmolLM2 drafter steps between target forwards: 42 ms spinning, 27 ms not)."""
        self.folder = Path(folder)
        self.manifest: EngineManifest = load_engine_manifest(self.folder)
        check_files(self.manifest, self.folder, full=verify_files)
        m = self.manifest
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = resolve_providers(provider)
        try:
            self.session = ort.InferenceSession(
                str(self.folder / m.model_file), sess_options=opts, providers=providers
            )
        except Exception as e:  # ORT raises its own exception types for unreadable models
            raise ArtifactError(
                f"{self.folder / m.model_file}: ONNX Runtime could not load it ({_first_line(e)})"
            ) from None
        self.providers = self.session.get_providers()
        inputs = {i.name: i for i in self.session.get_inputs()}
        missing = [n for n in m.input_names if n not in inputs]
        if missing:
            raise ArtifactError(f"{self.folder}: model lacks inputs named in the manifest: {missing}")
        self.kv_dtype = _NP_DTYPES.get(inputs[m.past_key_template.format(i=0)].type, np.float32)
        self._past_names = [
            (m.past_key_template.format(i=i), m.past_value_template.format(i=i))
            for i in range(m.num_layers)
        ]
        self._present_names = [
            (m.present_key_template.format(i=i), m.present_value_template.format(i=i))
            for i in range(m.num_layers)
        ]
        self._device = "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"
        self.forward_count = 0
        self.forward_time = 0.0
        self.reset()

    def reset(self) -> None:
        m = self.manifest
        empty = np.zeros((1, m.num_kv_heads, 0, m.head_dim), dtype=self.kv_dtype)
        empty_value = ort.OrtValue.ortvalue_from_numpy(empty, self._device)
        self._cache: list[tuple[ort.OrtValue, ort.OrtValue]] = [
            (empty_value, empty_value) for _ in range(m.num_layers)
        ]
        self.n_cached = 0

    def forward(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        s = ids.shape[1]
        m = self.manifest
        if s == 0:
            raise ValueError("forward needs at least one token")
        total = self.n_cached + s
        if total > m.max_context:
            raise ContextLimitError(
                f"{m.name}: {total} positions would exceed the maximum context of {m.max_context}"
            )
        start = time.perf_counter()
        io = self.session.io_binding()
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("attention_mask", np.ones((1, total), dtype=np.int64))
        if m.has_position_ids:
            io.bind_cpu_input("position_ids", np.arange(self.n_cached, total, dtype=np.int64)[None])
        for (k_name, v_name), (k, v) in zip(self._past_names, self._cache, strict=True):
            io.bind_ortvalue_input(k_name, k)
            io.bind_ortvalue_input(v_name, v)
        io.bind_output("logits", "cpu")
        for k_name, v_name in self._present_names:
            io.bind_output(k_name, self._device)
            io.bind_output(v_name, self._device)
        self.session.run_with_iobinding(io)
        out = io.get_outputs()
        logits = out[0].numpy()[0]  # [s, V]
        self._cache = [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(m.num_layers)]
        self.n_cached = total
        self.forward_count += 1
        self.forward_time += time.perf_counter() - start
        return logits

    def truncate(self, n: int) -> None:
        if n >= self.n_cached:
            return
        if n < 0:
            raise ValueError(f"cannot truncate to {n} positions")
        cut = []
        for k, v in self._cache:
            cut.append(tuple(
                ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(x.numpy()[:, :, :n]), self._device)
                for x in (k, v)
            ))
        self._cache = cut  # type: ignore[assignment]
        self.n_cached = n


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
