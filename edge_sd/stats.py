"""Counters and timings that every generation returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    """Statistics of one generation.

    target_forwards counts the decoding rounds (one target forward each); the prompt's prefill is
    counted apart (prefill_s), and so is the first token where the prefill's last row gave it
    (prefill_emitted), so tokens_per_target_forward is the rounds' tokens per verification forward
    (1.0 for plain decoding) and decoded_tokens / decode_s the rate after the prefill, as llama.cpp
    counts its `eval` runs.
    """

    algorithm: str = "plain"
    lookahead: int = 0
    prompt_tokens: int = 0  # the sequence before the reply (a conversation's earlier turns included)
    prefilled_tokens: int = 0  # of those, fed at the start of the reply (the rest was cached already)
    new_tokens: int = 0
    prefill_emitted: int = 0  # of new_tokens, drawn from the prefill's last row (0 or 1)
    target_forwards: int = 0
    drafter_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    time_target_s: float = 0.0
    time_drafter_s: float = 0.0
    wall_s: float = 0.0
    stop_reason: str = ""
    rounds_by_drafts: dict[int, int] = field(default_factory=dict)  # m -> rounds that drafted m (0: plain)
    schedule: dict = field(default_factory=dict)  # what the lookahead schedule did (edge_sd/schedules)

    def count_round(self, proposed: int, accepted: int, target_s: float) -> None:
        self.target_forwards += 1
        self.time_target_s += target_s
        self.proposed += proposed
        self.accepted += accepted
        self.rounds_by_drafts[proposed] = self.rounds_by_drafts.get(proposed, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def decoded_tokens(self) -> int:
        """New tokens the rounds emitted (the prefill's first token left out)."""
        return self.new_tokens - self.prefill_emitted

    @property
    def decode_s(self) -> float:
        """Seconds after the prefill."""
        return self.wall_s - self.prefill_s

    @property
    def tokens_per_target_forward(self) -> float:
        return self.decoded_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def time_other_s(self) -> float:
        return max(0.0, self.wall_s - self.prefill_s - self.time_target_s - self.time_drafter_s)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("acceptance_rate", "decoded_tokens", "tokens_per_target_forward", "time_other_s",
                    "tokens_per_second"):
            d[key] = getattr(self, key)
        return d

    def line(self) -> str:
        """The compact one-line summary printed after `edge-sd generate`."""
        parts = [
            f"{self.algorithm}",
            f"{self.new_tokens} tokens in {self.wall_s:.2f}s ({self.tokens_per_second:.1f} tok/s)",
            f"{self.target_forwards} target fwd ({self.tokens_per_target_forward:.2f} tok/fwd)",
        ]
        if self.algorithm != "plain":
            parts.append(f"k={self.lookahead} accept {self.acceptance_rate:.0%} ({self.accepted}/{self.proposed})")
            parts.append(f"{self.drafter_forwards} drafter fwd")
            rounds = self.schedule.get("rounds")
            if rounds:  # the cost schedule: rounds per algorithm and draft length
                parts.append("rounds " + " ".join(f"{k} {v}" for k, v in rounds.items()))
        parts.append(
            f"time target {self.time_target_s:.2f}s drafter {self.time_drafter_s:.2f}s "
            f"other {self.time_other_s:.2f}s prefill {self.prefill_s:.2f}s"
        )
        parts.append(f"stop: {self.stop_reason}")
        return " | ".join(parts)
