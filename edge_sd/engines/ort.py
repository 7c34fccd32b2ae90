"""The ONNX Runtime engine as apps and tools use it: `OrtSession` (engines/session.py), and
`OrtEngine`, which takes a session or loads one from an engine folder (engines/engine.py holds the
forwards)."""

from __future__ import annotations

from pathlib import Path

from edge_sd.engines import engine
from edge_sd.engines.consistency import SPLIT_AT
from edge_sd.engines.engine import SCRATCH_ROWS
from edge_sd.engines.kv import window_offset
from edge_sd.engines.providers import SPIN
from edge_sd.engines.session import DEFAULT_CAPACITY, OrtSession

__all__ = ["DEFAULT_CAPACITY", "SCRATCH_ROWS", "SPIN", "SPLIT_AT", "OrtEngine", "OrtSession", "window_offset"]


class OrtEngine(engine.OrtEngine):
    """An engine (engines/engine.py) over `source`: an OrtSession, or an engine folder to load one
    from with the other arguments, as OrtSession takes them."""

    def __init__(
        self,
        source: Path | str | OrtSession,
        provider: str = "auto",
        threads: int | None = None,
        verify_files: bool = False,
        spin: str = "always",
        capacity: int | None = None,
        min_step_positions: int | None = None,
        release_window: bool = False,
    ):
        if not isinstance(source, OrtSession):
            source = OrtSession(Path(source), provider, threads, verify_files, spin, min_step_positions)
        super().__init__(source, capacity=capacity, release_window=release_window)
