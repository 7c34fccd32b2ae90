"""The Engine protocol: a decoder with a KV cache that can be appended to and cut back."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edge_sd.manifest import EngineManifest


class Engine(Protocol):
    """Everything the decoding loop, the drafter state and the checks read or set on an engine."""

    manifest: EngineManifest
    n_cached: int  # positions held in the KV cache
    # Every forward feeds at least this many positions (re-feeding cached ones), so that all forwards
    # run the same kernels (manifest `min_step_positions`); consistency checks set it.
    min_step: int
    # The LM head computes at least this many of a forward's rows (manifest `min_head_rows`).
    head_rows: int
    forward_count: int  # forwards run so far
    # Seconds spent in them: the one clock of forwards, which the loop, the drafter state and the
    # cost measurement read before and after a forward.
    forward_time: float

    @property
    def cached_ids(self) -> np.ndarray:
        """The ids at the cached positions, in order."""
        ...

    def forward(self, ids: np.ndarray, last: int | None = None, *, scratch: bool = False) -> np.ndarray:
        """Feed ids [s] after the cached positions and cache them; returns the logits [n, V] of the
        last n = `last` positions (all s when None; an engine may compute only those). scratch: the
        caller reads them before the engine's next forward, so they may live in a buffer it reuses."""
        ...

    def truncate(self, n: int) -> None:
        """Roll the KV cache back to its first n positions."""
        ...

    def reset(self) -> None:
        """Empty the KV cache."""
        ...

    def reserve(self, n: int) -> None:
        """Make room for n cached positions up front (a preallocated cache then never grows)."""
        ...

    def prepare(self) -> None:
        """Make ready what the first forward needs (an engine over a session built on first use), so
        that the forward's time is the forward's."""
        ...
