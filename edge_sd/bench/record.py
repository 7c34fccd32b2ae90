"""What the benchmark records of one run: one configuration on one prompt (every harness writes these)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Record:
    """One configuration on one prompt."""

    engine: str
    mode: str
    algorithm: str
    k: int
    prompt: str
    new_tokens: int
    wall_s: float
    prefill_s: float
    target_s: float
    drafter_s: float
    target_forwards: int
    proposed: int
    accepted: int
    token_ids: list[int] = field(default_factory=list)
    schedule: str = "static"
    keep: float = 1.0
