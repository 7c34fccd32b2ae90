"""An exported decoder loaded into ONNX Runtime: the session, built once (from the runtime cache
where one was prepared), shared by the engines of every request."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edge_sd.engines import host_memory, large_pages, lm_head, prepared
from edge_sd.engines.consistency import BROKEN_RTOL
from edge_sd.engines.consistency import check as check_consistency
from edge_sd.engines.engine import _NP_DTYPES, OrtEngine
from edge_sd.engines.providers import PROVIDERS, UNVERIFIED, resolve_providers, session_options, tensorrt_options
from edge_sd.errors import ArtifactError, ProviderError, UsageError
from edge_sd.layout import CACHE_DIR, DATA, ORT_DIR
from edge_sd.manifest import KEEP_INPUT, EngineManifest, check_files, load_engine_manifest

# A shared-buffer cache starts this large (positions) unless told otherwise, and grows by doubling;
# `reserve` sizes it for a whole generation up front so that it never grows mid-way.
DEFAULT_CAPACITY = 1024


class OrtSession:
    """One exported decoder loaded into ONNX Runtime: the session and what drives it, immutable after
    load. Safe to share between threads (ONNX Runtime runs one InferenceSession from several at once); each
    request drives it through an `OrtEngine` of its own (its IO binding and KV cache)."""

    def __init__(
        self,
        folder: Path,
        provider: str = "auto",
        threads: int | None = None,
        verify_files: bool = False,
        spin: str = "always",
        min_step_positions: int | None = None,
        defer: bool = False,
    ):
        """spin: when ONNX Runtime's worker threads spin (busy-wait) for work. "always": also between runs,
        ready for the next one; an engine alone gains from it. "run": inside a run only, between its many
        small kernels, stopping as it returns (`session.force_spinning_stop`): for a target and a drafter that
        take turns, where one session's threads spinning between runs steal the cores the other runs on.
        "never": not at all (`benchmarks/spin.py` compares the three).

        min_step_positions: override the manifest's (1 for a drafter, whose forwards need not agree
        with each other).

        defer: build the ONNX Runtime session when it is first needed (`load`, or an engine's first
        forward) instead of now: a pair's drafter, which a cost-aware generation may never run. Only
        with min_step_positions given, as a drafter's is: the consistency check a session on another
        provider runs at build could change what engines made before it read.
        """
        if threads is not None and threads < 1:
            raise UsageError(f"threads must be at least 1, got {threads}", field="threads")
        if defer and min_step_positions is None:
            raise ValueError("a deferred session needs min_step_positions (engines read it before the build)")
        self.folder = Path(folder)
        self.manifest: EngineManifest = load_engine_manifest(self.folder)
        check_files(self.manifest, self.folder, full=verify_files)
        self.verify_files = verify_files
        # What a user should hear of the load (a runtime cache prepared again because it was damaged).
        self.notes: list[str] = []
        m = self.manifest
        host_memory.map_large_blocks()
        self._own_min_step = min_step_positions is None  # else a caller's: not measured at build
        self.min_step = m.min_step_positions if min_step_positions is None else max(1, min_step_positions)
        self.head_rows = (m.min_head_rows or self.min_step) if min_step_positions is None else self.min_step
        # The runtime computes an 8-bit LM head itself where it can (engines/lm_head.py): the graph's
        # worker threads then stop spinning as a run returns, since the head's threads run next.
        self._own_head = bool(m.lm_head) and m.device == "cpu" and lm_head.wanted()[0]
        opts = session_options(threads, "run" if self._own_head and spin == "always" else spin)
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        self._head_threads = threads or len(cores)
        # optimum's graphs are standard ONNX and run anywhere; the builder makes a graph for one device.
        names = resolve_providers(provider, cpu_only=m.export_path == "builder" and m.device == "cpu")
        self.capacity = min(m.max_context, max(DEFAULT_CAPACITY, m.sliding_window or 0))
        chosen: list = [
            (n, tensorrt_options(m, self.folder, self.capacity if m.kv_layout == "shared" else m.max_context,
                                 m.max_context))
            if n == PROVIDERS["tensorrt"] else n for n in names
        ]
        self._build_args = (opts, chosen, names)
        self._ready = False
        self._lock = threading.Lock()
        if not defer:
            self._load()

    # Set when the session is built: `__getattr__` builds a deferred one when any of them is first read.
    session: ort.InferenceSession
    graph_cache: str
    attention_by_kernel: bool  # every attention node edge-sd's kernel (engines/attention.py)
    providers: list[str]
    kv_dtype: type
    device: str
    keeps_logits: bool
    consistency: dict | None
    head: lm_head.LmHead | None  # the LM head computed outside the graph, where it is
    _BUILT = frozenset(("session", "graph_cache", "attention_by_kernel", "providers", "kv_dtype", "device",
                        "keeps_logits", "consistency", "head"))

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes not set yet: those of a session not built yet.
        if name not in OrtSession._BUILT or "_lock" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        self.load()
        return self.__dict__[name]

    @property
    def loaded(self) -> bool:
        """Whether the ONNX Runtime session is built (a deferred one: not before it is needed)."""
        return "session" in self.__dict__

    def load(self) -> None:
        """Build the session now, if it is not built yet (thread-safe: built once)."""
        if not self._ready:
            with self._lock:
                if not self._ready:
                    self._load()

    def _load(self) -> None:
        m = self.manifest
        opts, chosen, names = self._build_args
        self.session, self.graph_cache, self.attention_by_kernel = prepared.build(
            self.manifest, self.folder, opts, chosen, names, whole=self.verify_files, notes=self.notes)
        self.providers = self.session.get_providers()
        unverified = [short for short, full in PROVIDERS.items() if short in UNVERIFIED and full in self.providers]
        if unverified:
            warnings.warn(f"{m.name}: running through {', '.join(unverified)}, which edge-sd has not been verified "
                          "on: check its output against --provider cuda or cpu", stacklevel=2)
        # Inputs with a default (an initializer of their name) are listed apart: `logits_to_keep`.
        inputs = {i.name: i for i in [*self.session.get_inputs(), *self.session.get_overridable_initializers()]}
        missing = [n for n in m.input_names if n not in inputs]
        if missing:
            raise ArtifactError(f"{self.folder}: model lacks inputs named in the manifest: {missing}")
        self.kv_dtype = _NP_DTYPES.get(inputs[m.past_key_template.format(i=0)].type, np.float32)
        self.device = "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"
        # A graph with `logits_to_keep` (export/logits.py) computes the LM head for the positions asked.
        self.keeps_logits = KEEP_INPUT in inputs
        self.head = None
        if self._own_head and self.device == "cpu" and self.keeps_logits and m.lm_head["rows"] == m.logits_width:
            # The load read the graph's prepacked copy of the head, which no forward reads now: let
            # go of it before the head's own copy is made, so that the two are never held together.
            large_pages.release(self.folder / CACHE_DIR / ORT_DIR / DATA)
            self.head = lm_head.from_engine(self.folder, m.lm_head, self._head_threads)
        # min_step_positions was measured where the export validated the graph; on another provider
        # (a CPU export run on CUDA, a CUDA export not validated on a GPU) other kernels run: measured
        # again here, in a few dozen forwards (engines/consistency.py).
        consistency = None
        if self._own_min_step and m.validation.get("provider", "cpu") != self.device:
            consistency = check_consistency(self.engine())
            self.min_step = consistency["min_step_positions"]
            self.head_rows = consistency["min_head_rows"] or self.min_step
            worst = max(consistency["single"], consistency["multi"])
            if worst > BROKEN_RTOL:  # rounding moves logits by 1e-6..1e-2 of their scale; this is not that
                advice = " (run it with --provider cpu)" if m.device == "cpu" else ""
                raise ProviderError(
                    f"{m.name}: through {self.providers[0]} its forwards disagree with each other by {worst:.1e} "
                    f"of the logits' scale: its results would be wrong here{advice}"
                )
        self.consistency = consistency
        self._ready = True

    def engine(self, capacity: int | None = None, release_window: bool = False) -> OrtEngine:
        """A new engine over this OrtSession: an empty KV cache of its own (release_window: OrtEngine's)."""
        return OrtEngine(self, capacity=capacity, release_window=release_window)
