"""What a round costs, in seconds: the estimates auto's cost schedule plans with (lookahead.py), each
starting from the engines' measured costs and following the rounds' own timings.

A round that drafts m tokens with an algorithm costs a target forward over m + 1 positions, m drafted
tokens at that algorithm's cost per token, and the rest of the round (verification, the text, syncing
the drafter) over m + 1 positions; a drafter that must first catch up (its prompt, or tokens committed
during plain steps) pays each such position once more.
"""

from __future__ import annotations

# Estimates follow new measurements with this weight (exponential moving average), after a plain mean
# over their first 1 / COST_WEIGHT measurements.
COST_WEIGHT = 0.1


class Estimate:
    """A cost that follows its measurements: their plain mean at first (a starting guess counts as
    `prior` measurements, so a poor one is soon outweighed), then an exponential moving average."""

    def __init__(self, value: float, prior: int = 1):
        self.value, self.n = value, prior

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(COST_WEIGHT, 1.0 / self.n) * (x - self.value)


class CostModel:
    """The cost estimates, and how the rounds teach them."""

    def __init__(self, target: dict[int, float], draft: dict[str, float], catch_up: float = 0.0,
                 learn: bool = True):
        """target: seconds of a target forward over s positions (s -> seconds); draft: seconds per
        drafted token, by algorithm; catch_up: seconds of each position a drafter forward feeds beyond
        its first. learn: follow the rounds' timings (else the costs given stay as they are: what a
        seeded generation needs to be reproducible)."""
        self.learn = learn
        self.target_prior = dict(target)
        self.target_cost = {s: Estimate(c) for s, c in target.items()}
        self.target_seen: set[int] = set()  # sizes measured in rounds (with a starting cost above 0)
        self._drift: dict[int, float] = {}  # size -> _drift_of(size), kept as rounds are observed
        self.draft_cost = {a: Estimate(c) for a, c in draft.items()}
        self.catch_up = Estimate(catch_up)
        # The rest of a round over s positions (verification, warping p, the text, syncing the
        # drafter): more for a round that drafts than for a plain step, and growing with s when
        # sampling warps each position's distribution over a large vocabulary; learnt online.
        self.other_cost: dict[int, Estimate] = {}

    def target(self, s: int) -> float:
        """A forward over s positions: its own estimate once measured, else its starting cost scaled as
        the nearest measured size's has moved from its own. Starting costs measured on a busy machine
        (or another one) can be off by a factor; plain steps soon show the factor, and without it
        every draft would look as dear as it did then and never run to show otherwise."""
        if s in self.target_seen:
            return self.target_cost[s].value
        return self.target_cost[s].value * self._drift.get(s, 1.0)

    def _drift_of(self, s: int) -> float:
        """How far the forward measured nearest to s positions has moved from its starting cost."""
        near = min(self.target_seen, key=lambda x: (abs(x - s), x))
        return self.target_cost[near].value / self.target_prior[near]

    def draft(self, algo: str) -> float:
        """Seconds per drafted token: measured, else the starting cost moved as the target's step has
        (the same machine, busy or not, runs both)."""
        c = self.draft_cost[algo]
        return c.value if c.n > 1 else c.value * self._drift.get(1, 1.0)

    def catch_up_cost(self) -> float:
        return self.catch_up.value if self.catch_up.n > 1 else self.catch_up.value * self._drift.get(1, 1.0)

    def other(self, s: int) -> float:
        """The rest of a round over s positions: measured, else scaled from the nearest measured size
        below it (a plain step's for the first draft), else nothing yet."""
        if s in self.other_cost:
            return self.other_cost[s].value
        below = [x for x in self.other_cost if x < s]
        return self.other_cost[max(below)].value * s / max(below) if below else 0.0

    def round(self, m: int, draft_per_token: float) -> float:
        """Seconds of a round drafting m tokens at `draft_per_token` each (m = 0: a plain step)."""
        return self.extended(m, m, draft_per_token, 0)

    def extended(self, m: int, drafted: int, draft_per_token: float, behind: int) -> float:
        """Seconds of a round proposing m candidates of which the drafter drafts the last `drafted`
        (a chain: the lookup's first), its first forward feeding `behind` positions beyond one."""
        return self.target(m + 1) + drafted * draft_per_token + behind * self.catch_up_cost() + self.other(m + 1)

    def plain(self) -> float:
        return self.round(0, 0.0)

    def observe(self, s: int, target_s: float, other_s: float, algo: str | None = None, proposed: int = 0,
                draft_s: float = 0.0, caught_up_s: float = 0.0, behind: int = 0) -> None:
        """A round over s positions: its target forward and the rest; for a round that drafted
        `proposed` tokens with `algo`, its drafting, of which `caught_up_s` went to `behind` positions
        caught up. That part is paid once whatever the draft's length, so it must not make every later
        draft look dearer: it is kept apart."""
        if not self.learn:
            return
        if s in self.target_cost:
            self.target_cost[s].add(target_s)
            if self.target_prior[s] > 0:
                self.target_seen.add(s)
                # once a round, not at every estimate a plan reads
                self._drift = {x: self._drift_of(x) for x in self.target_cost}
        self.other_cost.setdefault(s, Estimate(0.0, prior=0)).add(other_s)
        if algo is not None and proposed:
            self.draft_cost[algo].add(max(0.0, draft_s - caught_up_s) / proposed)
            if behind:
                self.catch_up.add(caught_up_s / behind)

    def summary(self) -> dict:
        return {
            "target_ms": {s: round(1e3 * self.target(s), 2) for s in sorted(self.target_cost)},
            "draft_ms_per_token": {a: round(1e3 * self.draft(a), 2) for a in self.draft_cost},
            "other_ms": {s: round(1e3 * c.value, 2) for s, c in sorted(self.other_cost.items())},
            "catch_up_ms_per_position": round(1e3 * self.catch_up_cost(), 3),
        }
