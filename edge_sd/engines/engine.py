"""An engine over an ONNX Runtime session: one request's IO binding and KV cache (in one of the
manifest's two layouts), and its forwards."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from edge_sd.engines import host_memory
from edge_sd.engines.consistency import SPLIT_AT
from edge_sd.engines.kv import ConcatKV, SharedKV, window_offset
from edge_sd.errors import ArtifactError, ContextLimitError
from edge_sd.manifest import GLOBAL_INPUT, KEEP_INPUT, WINDOW_INPUT, EngineManifest

if TYPE_CHECKING:
    from edge_sd.engines.session import OrtSession

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}

# Logit rows a scratch buffer holds (forward(scratch=True)): the longest verification forward, a
# prompt lookup draft of 16 and the token before it (schedules.choose.DEFAULT_MAX_LOOKUP).
SCRATCH_ROWS = 17

# A forward of at least this many positions (a long prompt's chunk, 64 positions at the least: the
# decoder's prefill_stop) gives the heap's free pages back after it (engines/host_memory.py): a
# millisecond or so against a tenth of a second or more of forward. Verification forwards are shorter.
GIVE_BACK_AFTER = 64

# `logits_to_keep` for a forward whose logits the runtime computes (engines/lm_head.py): the graph's
# head then gets no rows (its slice starts past the end).
NO_HEAD_ROWS = -(1 << 62)

# Positions by which the grouped global layers' bindings move (manifest `grouped_attention`): their
# writers' views start, and their whole caches end, at multiples of this.
GROUPED_STEP = 64


class OrtEngine:
    """One request's view of an exported decoder: an IO binding and a KV cache of its own, over a
    session that may be shared (`OrtSession.engine`).

    The KV cache never crosses into numpy per step: a concat-layout graph's `present.*` values are
    bound back as the next call's past; a shared-layout graph writes into one buffer per layer that is
    bound as both past and present, so a step writes only its new positions and cutting the cache back
    is a change of length. Every forward covers at least `min_step` positions (re-feeding cached
    ones), and its LM head at least `head_rows` of them, so that all forwards run the same kernels
    (manifest, `min_step_positions` and `min_head_rows`).
    """

    def __init__(self, source: OrtSession, capacity: int | None = None, release_window: bool = False):
        """source: the session (`OrtSession.engine` makes one; `edge_sd.engines.ort.OrtEngine` also
        loads one from an engine folder). capacity: initial KV positions of a shared-layout cache.

        release_window: where sliding-window layers read views of their cache, give the memory of the
        positions no view will read again back to the system as the views move on, so that those
        layers hold about a window of positions however long the text (Gemma-3: 15 of 18 layers).
        Cutting the cache back below the released positions then empties it (`truncate`): the next
        forward feeds the sequence again. For an engine whose cache only grows but for the cuts of
        decoding (a generator's target); not for one that measures forwards at chosen positions."""
        self.shared = source
        self.manifest: EngineManifest = source.manifest
        self.min_step = source.min_step
        self.head_rows = source.head_rows
        m = self.manifest
        # Inputs are slices of these: no per-step allocation of masks and positions.
        self._ones = np.ones((1, m.max_context), dtype=np.int64)
        self._positions = np.arange(m.max_context, dtype=np.int64)[None]
        self._fed = np.zeros(m.max_context, dtype=np.int64)  # the id at each cached position
        self.forward_count = 0
        self.forward_time = 0.0
        self.n_cached = 0
        self._scratch: np.ndarray | None = None  # forward(scratch=True)'s logits
        self._scratch_values: dict[int, Any] = {}
        # The binding and the KV cache need the built session: over a deferred one they are made
        # by the first forward (or `prepare`), with the room `reserve` asked for by then.
        self._capacity = min(m.max_context, max(capacity or source.capacity, m.sliding_window or 0))
        self._io: Any = None
        self._kv: ConcatKV | SharedKV | None = None
        self._keep: np.ndarray | None = None
        views = m.window_views
        self._window, self._window_layers = int(views.get("window", 0)), list(views.get("layers", []))
        # The offset's step (manifest `window_views`; 0: views off). Export validation sets it on an
        # engine to measure it (engines/consistency.py, window_granule).
        self.window_granule = int(views.get("granule", 0))
        self._offset: np.ndarray | None = None
        self._grouped = list(m.grouped_attention)
        self._global_offset: np.ndarray | None = None
        self.release_window = release_window
        if source.loaded:
            self._bind()

    def prepare(self) -> None:
        """Build what the first forward needs (a deferred session, this engine's binding), so that it
        is not paid inside a timed forward."""
        if self._kv is None:
            self._bind()

    def _bind(self) -> None:
        source, m = self.shared, self.manifest
        self._io = source.session.io_binding()
        self._head = source.head
        # The first output bound is the one a forward reads: the hidden states where the runtime
        # computes the LM head, else the logits.
        if self._head is not None:
            self._io.bind_output(m.lm_head["output"], "cpu")
        self._io.bind_output("logits", "cpu")
        kv_class = SharedKV if m.kv_layout == "shared" else ConcatKV
        self._kv = kv_class(m, self._io, source.device, source.kv_dtype, self._capacity)
        self._keep = np.zeros(1, dtype=np.int64) if source.keeps_logits else None
        if self._keep is not None:  # bound as an OrtValue sharing _keep's memory: an input with a
            # default is not in the list `bind_cpu_input` checks names against
            self._keep_value = ort.OrtValue.ortvalue_from_numpy(self._keep)
            self._io.bind_ortvalue_input(KEEP_INPUT, self._keep_value)
        if self._window_layers and isinstance(self._kv, SharedKV) and source.device == "cpu" and m.num_kv_heads == 1:
            self._offset = np.zeros((), dtype=np.int64)  # bound as _keep is, written before each forward
            self._offset_value = ort.OrtValue.ortvalue_from_numpy(self._offset)
            self._io.bind_ortvalue_input(WINDOW_INPUT, self._offset_value)
        else:
            self.window_granule = 0  # views are of host memory and of one-head buffers
        if self._grouped:
            if not isinstance(self._kv, SharedKV):
                raise ArtifactError(f"{source.folder}: grouped_attention needs the shared KV layout")
            if source.device == "cpu":  # the writers' views, as the window layers' (host memory)
                self._global_offset = np.zeros((), dtype=np.int64)
                self._global_offset_value = ort.OrtValue.ortvalue_from_numpy(self._global_offset)
                self._io.bind_ortvalue_input(GLOBAL_INPUT, self._global_offset_value)
        logits_type = next(o.type for o in source.session.get_outputs() if o.name == "logits")
        self._logits_dtype = _NP_DTYPES.get(logits_type, np.float32)

    @property
    def can_view_windows(self) -> bool:
        """Whether this engine binds its sliding-window layers' views (window_granule picks the
        offsets; 0 keeps them whole)."""
        if self._kv is None:
            self._bind()
        return self._offset is not None

    @property
    def view_offset(self) -> int:
        """The offset the last forward's sliding-window views started at (0: whole, or no views)."""
        return int(self._offset) if self._offset is not None else 0

    # What the shared session holds, read through the engine.
    @property
    def session(self) -> ort.InferenceSession:
        return self.shared.session

    @property
    def providers(self) -> list[str]:
        return self.shared.providers

    @property
    def device(self) -> str:
        return self.shared.device

    @property
    def consistency(self) -> dict | None:
        return self.shared.consistency

    @property
    def folder(self) -> Path:
        return self.shared.folder

    @property
    def capacity(self) -> int:
        """Positions the cache holds without growing (max_context for the concat layout)."""
        if self._kv is None:
            return self.manifest.max_context if self.manifest.kv_layout != "shared" else self._capacity
        return self._kv.capacity

    @property
    def cached_ids(self) -> np.ndarray:
        """The ids at the cached positions, in order (a view: copy it to keep it)."""
        return self._fed[: self.n_cached]

    def reserve(self, n: int) -> None:
        """Make room for n cached positions now, so that the cache does not grow during a generation."""
        n = min(n, self.manifest.max_context)
        if self._kv is None:
            self._capacity = max(self._capacity, n)
        else:
            self._kv.ensure(n, self.n_cached)

    @property
    def released(self) -> int:
        """Positions whose sliding-window cache was given back (release_window); 0: none."""
        return self._kv.released if isinstance(self._kv, SharedKV) else 0

    def reset(self) -> None:
        if self._kv is not None:
            self._kv.truncate(0)
        self.n_cached = 0

    def forward(self, ids: np.ndarray, last: int | None = None, split: bool = True, *,
                scratch: bool = False) -> np.ndarray:
        """Logits [n, V] of the last n positions fed (n = last, or every one of ids). split=False: run
        as one forward even across a multiple of SPLIT_AT (the second part of a split). scratch: the
        logits are written into a buffer of the engine's own and returned as a view of it, good until
        its next forward (the decoding loop's forwards, read before the next one runs): no new block a
        forward, where a verification forward's 17 rows of a 262k vocabulary are 17 MB of pages the
        system would otherwise map and clear every round."""
        if self._kv is None:
            self._bind()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        s = len(ids)
        m = self.manifest
        if s == 0:
            raise ValueError("forward needs at least one token")
        if self.n_cached + s > m.max_context:
            raise ContextLimitError(
                f"{m.name}: {self.n_cached + s} positions would exceed the maximum context of {m.max_context}"
            )
        edge = (self.n_cached // SPLIT_AT + 1) * SPLIT_AT  # the next multiple of SPLIT_AT
        # Forwards are split for the kernels of ONNX Runtime's attention; edge-sd's computes a row alike
        # in any forward (engines/attention.py).
        if split and (self.min_step > 1 or m.previous_row_attention) and not self.shared.attention_by_kernel \
                and self.n_cached + s > edge:
            return self._split_forward(ids, last, edge)
        start_time = time.perf_counter()
        back = min(max(self.min_step - s, 0), self.n_cached)  # cached positions fed again
        if self.min_step > 1 and self.n_cached % SPLIT_AT == 0 and self.n_cached:
            # Plain decoding's step there feeds the position before the multiple again, and the
            # forwards after it read that position's cache as that step wrote it.
            back = max(back, 1)
        if back:
            ids = np.concatenate([self._fed[self.n_cached - back : self.n_cached], ids])
            self.truncate(self.n_cached - back)
        start = self.n_cached
        total = start + len(ids)
        n = s if last is None else max(1, min(last, s))
        logits = self._run(ids, start, n, scratch)
        if len(ids) >= GIVE_BACK_AFTER:
            host_memory.give_back()
        self._fed[start:total] = ids
        self.n_cached = total
        self.forward_count += 1
        self.forward_time += time.perf_counter() - start_time
        return logits

    def _split_forward(self, ids: np.ndarray, last: int | None, edge: int) -> np.ndarray:
        """A forward across `edge` (a multiple of SPLIT_AT), run as plain decoding's steps meet it: one
        forward up to it, then one from it. With two-position steps the second starts at the position
        before it (fed again), which is where plain decoding last writes that position's cache; and a
        forward that starts at that position is split too: the step that computed its logits in plain
        decoding ended there, and one running on across the edge computed them otherwise (an AMD EPYC
        with AVX-512, ONNX Runtime 1.32). One-position steps over a graph whose attention reads the
        previous position from the cache need no re-feeding: the second forward starts at it."""
        s = len(ids)
        k = edge - self.n_cached
        n = s if last is None else max(1, min(last, s))
        head = self.forward(ids[:k], last=max(1, n - (s - k)))
        if self.min_step > 1:
            self.truncate(edge - 1)
            rest = np.concatenate([self._fed[edge - 1 : edge], ids[k:]])
        else:
            rest = ids[k:]
        tail = self.forward(rest, last=min(n, s - k), split=False)
        return tail if n <= s - k else np.concatenate([head, tail])

    def _run(self, ids: np.ndarray, start: int, n: int, scratch: bool) -> np.ndarray:
        """One run of the graph over `ids` at positions start.., with the cache bound; the last n
        rows' logits [n, V]."""
        m, kv, io = self.manifest, self._kv, self._io
        assert kv is not None  # bound by forward
        total = start + len(ids)
        kv.ensure(total, start)
        if self._offset is not None and isinstance(kv, SharedKV):
            offset = window_offset(start, self._window, self.window_granule)
            kv.view(offset, self._window_layers)
            self._offset[()] = offset
            if self.release_window:
                kv.release(offset, self._window_layers)
        if self._grouped and isinstance(kv, SharedKV):
            if self._global_offset is not None:
                # The writers attend over the view's few positions (their output is not read); the
                # view holds the previous position they read back. Steps of GROUPED_STEP rebind rarely.
                # Where edge-sd's kernel computes the attention itself, it is given the whole cache.
                offset = 0 if self.shared.attention_by_kernel else max(start - 1, 0) // GROUPED_STEP * GROUPED_STEP
                kv.view(offset, self._grouped)
                self._global_offset[()] = offset
            kv.bind_whole(min(kv.capacity, -(-total // GROUPED_STEP) * GROUPED_STEP), self._grouped)
        io.bind_cpu_input("input_ids", ids[None])
        io.bind_cpu_input("attention_mask", self._ones[:, :total])
        if m.has_position_ids:
            io.bind_cpu_input("position_ids", self._positions[:, start:total])
        if self._head is not None:
            assert self._keep is not None  # the head is computed here only behind logits_to_keep
            self._keep[0] = NO_HEAD_ROWS
            return self._run_head(kv.bind_past(start), n, scratch)
        if self._keep is not None:
            # The LM head runs over at least head_rows rows: a 4-bit head's single-row kernel rounds
            # otherwise, and a plain step would not compute what a verification forward does.
            self._keep[0] = max(n, min(self.head_rows, len(ids)))
        names = ["logits", *kv.bind_past(start)]
        rows = int(self._keep[0]) if self._keep is not None else len(ids)
        buffer = self._scratch_rows(rows) if scratch else None
        if buffer is None:
            io.bind_output("logits", "cpu")
        else:
            io.bind_ortvalue_output("logits", buffer[1])
        self.shared.session.run_with_iobinding(io)
        raw = getattr(io, "_iobinding", None)
        if buffer is not None:
            if len(names) > 1:
                kv.after_run(dict(zip(names, io.get_outputs(), strict=False)))
            return buffer[0][0, -n:]
        if len(names) == 1 and raw is not None:
            # The logits alone are read (the cache was written in place): IOBinding.get_outputs would
            # wrap every bound output, each layer's KV buffers too, in a Python OrtValue, a quarter of
            # a millisecond a step for Gemma's 37 outputs; the binding's own vector is read instead
            # (a private attribute of ONNX Runtime's wrapper: where it is missing, the public call).
            return raw.get_outputs()[0].numpy()[0, -n:]  # [n, V]
        out = dict(zip(names, io.get_outputs(), strict=False))
        kv.after_run(out)
        return out["logits"].numpy()[0, -n:]

    def _run_head(self, cache: list[str], n: int, scratch: bool) -> np.ndarray:
        """The run of `_run` where the runtime computes the LM head: the graph gives the hidden states
        (and no logits rows), and the head's kernel the last n rows' logits."""
        io, kv, head = self._io, self._kv, self._head
        assert kv is not None and head is not None
        io.bind_output(self.manifest.lm_head["output"], "cpu")
        io.bind_output("logits", "cpu")
        self.shared.session.run_with_iobinding(io)
        raw = getattr(io, "_iobinding", None)
        if not cache and raw is not None:  # as in _run: the binding's own vector, where it has one
            hidden = raw.get_outputs()[0].numpy()
        else:
            out = dict(zip([self.manifest.lm_head["output"], "logits", *cache], io.get_outputs(), strict=False))
            if cache:
                kv.after_run(out)
            hidden = out[self.manifest.lm_head["output"]].numpy()
        buffer = self._scratch_rows(n) if scratch else None
        return head(hidden[0, -n:], buffer[0][0] if buffer is not None else None)

    def _scratch_rows(self, rows: int) -> tuple[np.ndarray, Any] | None:
        """The scratch logits buffer's first `rows` rows, as an array and as an OrtValue over the same
        memory (made once per row count); None where the forward's logits do not go there (another
        device, or more rows than a decoding round feeds: a prefill over a graph that computes every
        row's logits)."""
        if self.device != "cpu" or rows > SCRATCH_ROWS:
            return None
        if self._scratch is None:
            width = next(o.shape[-1] for o in self.session.get_outputs() if o.name == "logits")
            width = width if isinstance(width, int) else self.manifest.logits_width
            self._scratch = np.zeros((1, SCRATCH_ROWS, width), dtype=self._logits_dtype)
        view = self._scratch[:, :rows]
        value = self._scratch_values.get(rows)
        if value is None:
            value = self._scratch_values[rows] = ort.OrtValue.ortvalue_from_numpy(view)
        return view, value

    def truncate(self, n: int) -> None:
        if n >= self.n_cached:
            return
        if n < 0:
            raise ValueError(f"cannot truncate to {n} positions")
        if self.released and window_offset(n, self._window, self.window_granule) < self.released:
            # A forward from n would read released positions: the whole cache goes (a rewind deep into
            # a long text), and the next forward feeds the sequence from its start.
            self.reset()
            return
        if self._kv is not None:
            self._kv.truncate(n)
        self.n_cached = n
