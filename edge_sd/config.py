"""What to generate (GenerationConfig) and what a generation returns (GenerationResult)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from edge_sd.algorithms import ALGORITHMS
from edge_sd.errors import UsageError
from edge_sd.sampling import SamplingConfig
from edge_sd.stats import Stats

SCHEDULES = ("static", "heuristic", "confidence", "cost", "disco")
# Older name of plain decoding, still accepted.
ALIASES = {"ar": "plain"}


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate. temperature 0 is greedy. With a seed, the output is the same every time,
    for every algorithm (sampled auto then plans from fixed costs instead of live timings: Generator)."""

    max_new_tokens: int = 128
    # The sampler chain, applied in this order (sampling.py): penalties over the last repeat_last_n
    # tokens (-1: all; 0: none), temperature (0: greedy), top-k (0: off), top-p (1: off), min-p (0: off).
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # The text ends where the first stop string begins (the ids keep the token that completed it);
    # include_stop keeps the stop string in the text.
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    chat: bool = False
    algorithm: str = "auto"
    # static / heuristic: the (first) draft length [2 greedy, 1 sampling]; cost: the longest draft [6]
    lookahead: int | None = None
    # None: cost for auto (which picks the algorithm too; with DISCO on top when the pair folder holds
    # a disco.json calibrated for this kind of decoding, greedy or sampling, else in greedy decoding with
    # the confidence cut on top), static for a named algorithm
    schedule: str | None = None

    def check(self) -> GenerationConfig:
        """Raise UsageError for a bad value; returns the configuration with aliases resolved."""
        rules = (
            ("max_new_tokens", self.max_new_tokens >= 1, "must be at least 1"),
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be > 0"),
            ("repeat_last_n", self.repeat_last_n >= -1, "must be >= -1"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("lookahead", self.lookahead is None or self.lookahead >= 0, "must be >= 0"),
            ("seed", self.seed is None or self.seed >= 0, "must be >= 0"),
        )
        for name, ok, rule in rules:
            if not ok:
                raise UsageError(f"{name} {rule}, got {getattr(self, name)}", field=name)
        algorithm = ALIASES.get(self.algorithm, self.algorithm)
        if algorithm not in ALGORITHMS:
            raise UsageError(f"unknown algorithm {self.algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        if any(not s for s in self.stop):
            raise UsageError("stop strings must not be empty")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise UsageError(f"unknown lookahead schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        return replace(self, algorithm=algorithm)

    @property
    def sampling(self) -> SamplingConfig:
        """The sampler chain's settings."""
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                              self.repeat_last_n, self.presence_penalty, self.frequency_penalty)


@dataclass
class GenerationResult:
    """text: the new text (cut before a stop string); token_ids: the new target ids as generated (they
    keep the token that completed a stop string); prompt_ids: the target ids it continued."""

    text: str
    token_ids: list[int]
    stats: Stats
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}
