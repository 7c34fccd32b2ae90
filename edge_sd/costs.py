"""What the engines and a round cost, in seconds: measured (`measure`), stored in a pair folder
(`save`, `load`: written at export and by `edge-sd calibrate`), and the estimates auto's cost schedule
plans with (`CostModel`: schedules/cost.py), each starting from the engines' costs and following the rounds'
own timings.

A round that drafts m tokens with an algorithm costs a target forward over m + 1 positions, m drafted
tokens at that algorithm's cost per token, and the rest of the round (verification, the text, syncing
the drafter) over m + 1 positions; a drafter that must first catch up (its prompt, or tokens committed
during plain steps) pays each such position once more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from edge_sd.engines.engine import OrtEngine
from edge_sd.layout import COSTS_FILE
from edge_sd.manifest import write_aside

# The engines' costs measured at load: target forwards over 1 and K+1 positions (linear in between)
# and drafter steps, after this many cached positions, median of CALIBRATION_REPEATS. On a noisy
# 2-core machine a median of 3 could store a drafter step well below what it runs at, and auto then
# drafted with it where drafting lost; 9 runs cost well under a second more.
CALIBRATION_CONTEXT = 64
CALIBRATION_REPEATS = 9
# Target forwards measured over these many positions (and over k_max + 1), linear in between: up to
# the longest verification auto runs, a prompt lookup draft of 16 and the position after it. A forward's
# cost does not grow linearly in its positions (its products change kernels as rows are added): a line
# through two sizes misstates the others.
MEASURED_SIZES = (1, 2, 3, 5, 9, 17)
# Estimates follow new measurements with this weight (exponential moving average), after a plain mean
# over their first 1 / COST_WEIGHT measurements.
COST_WEIGHT = 0.1


class Costs(NamedTuple):
    """What the engines cost: seconds of a target forward over s positions (s -> s), of a one-position
    drafter step, and of each position a drafter forward feeds beyond its first (catching up: the
    prompt, or the tokens committed during plain steps)."""

    target: dict[int, float]
    step: float
    position: float

    def extended(self, k_max: int) -> Costs:
        """Target costs for s = 1..k_max+1, linear beyond the largest measured."""
        last = max(self.target)
        slope = (self.target[last] - self.target[1]) / max(1, last - 1)
        return self._replace(target={s: self.target.get(s, self.target[1] + slope * (s - 1))
                                     for s in range(1, k_max + 2)})

    def to_json(self) -> dict:
        return {"target": {str(s): c for s, c in self.target.items()}, "step": self.step, "position": self.position}

    @classmethod
    def from_json(cls, data: dict) -> Costs:
        return cls({int(s): float(c) for s, c in data["target"].items()}, float(data["step"]), float(data["position"]))


def save(folder: Path, costs: Costs) -> Path:
    return write_aside(Path(folder) / COSTS_FILE, json.dumps(costs.to_json(), indent=1) + "\n")


def load(folder: Path | None) -> tuple[Costs | None, str]:
    """The costs a pair folder stores (None where it has none), and why they were not read ("" when
    they were, or there were none)."""
    path = Path(folder) / COSTS_FILE if folder is not None else None
    if path is None or not path.is_file():
        return None, ""
    try:
        return Costs.from_json(json.loads(path.read_text(encoding="utf-8"))), ""
    except (ValueError, KeyError, TypeError, OSError):
        return None, f"{path} unreadable: the engines' costs are measured at load instead"


def by_size(target_bytes: int, drafter_bytes: int | None, k_max: int) -> Costs:
    """Costs from the engines' sizes alone, in target steps: a CPU decodes at a rate set by the bytes
    it reads, so a drafter step costs a target step times the ratio of their weights."""
    # A forward over s positions costs a little more a position (small models on a CPU are bound by
    # reading their weights, which a longer forward shares).
    target = {s: 1.0 + 0.01 * (s - 1) for s in range(1, k_max + 2)}
    if drafter_bytes is None:
        return Costs(target, 0.0, 0.0)
    ratio = drafter_bytes / max(1, target_bytes)
    return Costs(target, ratio, ratio / 10)


def measure(target: OrtEngine, drafter: OrtEngine | None, k_max: int) -> Costs:
    """Target forwards over s = 1..k_max+1 positions, a drafter step and a drafter position caught up,
    timed now on these engines (which it leaves empty)."""
    span = min(max(k_max + 1, MEASURED_SIZES[-1]), target.manifest.max_context - CALIBRATION_CONTEXT)
    t_ids = np.arange(CALIBRATION_CONTEXT + span) % min(target.manifest.vocab_size, 1000) + 3
    # Each size runs once untimed first: a GPU's first forward of a new shape pays one-off costs
    # (several times a step), and a size first met mid-generation would teach the cost model that
    # drafting costs ten times what it does.
    median_forward(target, t_ids, CALIBRATION_CONTEXT, range(2, span), repeats=0)
    sizes = sorted({s for s in MEASURED_SIZES if s < span} | {span})
    measured = {s: median_forward(target, t_ids, CALIBRATION_CONTEXT, s) for s in sizes}
    step = fill = 0.0  # no drafter (prompt lookup alone): no drafter forwards to pay
    if drafter is not None:
        d_ids = np.arange(CALIBRATION_CONTEXT + 1) % min(drafter.manifest.vocab_size, 1000) + 3
        step = median_forward(drafter, d_ids, CALIBRATION_CONTEXT, 1)
        # A prompt's worth of positions at once (once untimed, once timed): from it alone auto judges
        # whether a generation's first draft gains back the drafter's prompt, until one has.
        fill = median_forward(drafter, d_ids, 1, CALIBRATION_CONTEXT - 1, repeats=1)
    return Costs({s: float(np.interp(s, sizes, [measured[x] for x in sizes])) for s in range(1, span + 1)},
                 step, max(0.0, fill - step) / (CALIBRATION_CONTEXT - 2))


def median_forward(engine: OrtEngine, ids: np.ndarray, context: int, sizes: int | range,
                   repeats: int = CALIBRATION_REPEATS) -> float:
    """Median seconds of a forward over s positions after `context` cached ones (sizes: one s, or
    several, each run `repeats` times), after one untimed forward of each."""
    sizes = range(sizes, sizes + 1) if isinstance(sizes, int) else sizes
    engine.reset()
    engine.reserve(context + max(sizes, default=1))
    engine.forward(ids[:context])
    times = []
    for s in sizes:
        for i in range(repeats + 1):
            engine.truncate(context)
            before = engine.forward_time
            engine.forward(ids[context : context + s])
            if i:
                times.append(engine.forward_time - before)
    engine.reset()
    return float(np.median(times)) if times else 0.0


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
