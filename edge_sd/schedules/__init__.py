"""How many tokens to draft, and with which algorithm (docs/algorithms.md,
"Choosing per round: `auto`").

A schedule plans each round from the past only (never from this round's draws), which is why every
schedule is lossless: it changes the speed, never the output. `plan` returns the proposer and the
number of tokens m to draft (0: a plain step); `observe` takes what the round cost and accepted.

- static: a fixed k;
- heuristic: k += 2 after a round where every candidate was accepted, else k -= 1 (at least 1);
- cost: the cost-aware choice: the m (and algorithm) that maximises expected tokens per
  second, from the engines' measured costs and the acceptance seen so far; m = 0 when no draft pays,
  nor when what the rest of the generation would gain does not cover the drafter's catching up (its
  prompt, first of all), with a short probe every few plain steps so that a text where drafts start to
  pay is noticed (one that must pay such catching up only after a few generations without a draft);
  the algorithm is chosen on optimistic acceptance, so that one seldom tried is tried again (and in
  greedy decoding the length too, so that depths seldom verified are tried);
- confidence: a static k, cut after a token the drafter was unsure of (top probability < 0.5); on top
  of the cost model, auto's greedy drafts on a pair with no DISCO calibrated for greedy decoding;
- disco: DISCO's classifier stops a draft early, on top of a static k or of the cost model (whose
  drafts may then run to its longest: the cost model starts them, DISCO ends them).
"""

from edge_sd.schedules.base import Plan, Round, Schedule, estimated
from edge_sd.schedules.cost import (
    CARRY,
    PROBE_EVERY,
    PROBE_EVERY_GENERATIONS,
    PROBE_EVERY_HOPELESS,
    Acceptance,
    CostSchedule,
    tokens_by_length,
)
from edge_sd.schedules.static import HeuristicSchedule, StaticSchedule
from edge_sd.schedules.stopped import ConfidenceCut, ConfidenceSchedule, DiscoSchedule, StoppedSchedule

__all__ = ["CARRY", "PROBE_EVERY", "PROBE_EVERY_GENERATIONS", "PROBE_EVERY_HOPELESS", "Acceptance", "ConfidenceCut",
           "ConfidenceSchedule", "CostSchedule", "DiscoSchedule", "HeuristicSchedule", "Plan", "Round", "Schedule",
           "StaticSchedule", "StoppedSchedule", "estimated", "tokens_by_length"]
