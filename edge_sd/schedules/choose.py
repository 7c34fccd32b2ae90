"""Which schedule a reply plans with, and how far it may draft: the configuration's schedule by name,
or auto's (the cost schedule with DISCO or the confidence cut ending its drafts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edge_sd.algorithms.base import DrafterState, Proposer
from edge_sd.algorithms.chain import ChainProposer
from edge_sd.config import GenerationConfig
from edge_sd.costs import CostModel, Costs
from edge_sd.errors import UsageError
from edge_sd.schedules.base import Schedule, estimated
from edge_sd.schedules.cost import CostSchedule
from edge_sd.schedules.static import HeuristicSchedule, StaticSchedule
from edge_sd.schedules.stopped import ConfidenceSchedule, DiscoSchedule, StoppedSchedule

# Settled by the real-pair benchmark on the default pair (benchmarks/results): greedy SLEM ran fastest
# at k=2, sampling at k=1 (a drafted token rejected half the time barely pays for itself).
DEFAULT_LOOKAHEAD = {"greedy": 2, "sample": 1}
# The cost-aware schedule (auto) chooses each round's draft length in 0..this (or lookahead).
DEFAULT_MAX_LOOKAHEAD = 6
# ... and a prompt lookup draft's in 0..this: it costs no model forward to make, a text quoting its
# source is accepted for dozens of tokens at a time, and a target forward over many positions costs
# little more than over one (the weights are read once).
DEFAULT_MAX_LOOKUP = 16


@dataclass
class Choice:
    """A reply's schedule and longest draft. key: where the schedule was borrowed from the model (its
    pool of cost schedules), to be returned when the reply ends; own: a seeded generator's own cost
    schedule, kept for its next reply."""

    schedule: Schedule
    k: int
    key: tuple | None = None
    own: CostSchedule | None = None


def cost_schedule_of(schedule: Schedule) -> CostSchedule | None:
    """The cost schedule under any stop rules (None: the schedule has none)."""
    while isinstance(schedule, StoppedSchedule):
        schedule = schedule.inner
    return schedule if isinstance(schedule, CostSchedule) else None


def choose(model: Any, cfg: GenerationConfig, algorithm: str, proposers: dict[str, Proposer],
           state: DrafterState | None, own: CostSchedule | None = None) -> Choice:
    """The schedule for a reply drafting with `proposers` (none: plain decoding)."""
    greedy = cfg.sampling.greedy
    name = cfg.schedule or ("cost" if algorithm == "auto" else "static")
    if not proposers:
        return Choice(StaticSchedule(None, 0), 0, own=own)
    disco = model.disco if state is not None else None  # a stop rule ends drafter drafts only
    if name == "disco" and disco is None:
        raise UsageError("the disco schedule needs a calibrated pair and a drafter: run `edge-sd calibrate PAIR` "
                         "first")
    if name == "confidence" and state is None:
        raise UsageError("the confidence schedule cuts a drafter's drafts: it needs a pair folder")
    names = {id(p): a.removeprefix("lookup+") for a, p in proposers.items()}  # DISCO's features: X of lookup+X
    if name == "disco" and algorithm != "auto":
        assert disco is not None and state is not None
        k = cfg.lookahead if cfg.lookahead is not None else disco.k
        (proposer,) = proposers.values()
        return Choice(DiscoSchedule(StaticSchedule(proposer, k), disco, names), k, own=own)
    if name in ("cost", "disco"):
        return _auto(model, cfg, name, proposers, state, own, names)
    k = cfg.lookahead if cfg.lookahead is not None else DEFAULT_LOOKAHEAD["greedy" if greedy else "sample"]
    if len(proposers) > 1:
        raise UsageError(f"the {name} schedule drafts with one algorithm: name it with --algorithm")
    (proposer,) = proposers.values()
    if name == "heuristic":
        return Choice(HeuristicSchedule(proposer, k, max(k, DEFAULT_MAX_LOOKAHEAD)), k, own=own)
    if name == "confidence":
        return Choice(ConfidenceSchedule(StaticSchedule(proposer, k)), k, own=own)
    return Choice(StaticSchedule(proposer, k), k, own=own)


def _auto(model: Any, cfg: GenerationConfig, name: str, proposers: dict[str, Proposer], state: DrafterState | None,
          own: CostSchedule | None, names: dict[int, str]) -> Choice:
    greedy = cfg.sampling.greedy
    k = cfg.lookahead if cfg.lookahead is not None else DEFAULT_MAX_LOOKAHEAD
    free = any(p.drafter is None for p in proposers.values())
    longest = cfg.lookahead if cfg.lookahead is not None else max(k, DEFAULT_MAX_LOOKUP) if free else k
    choice = _cost(model, cfg, proposers, k, longest, own)
    cost = choice.schedule
    # A draft's catching up is told apart from its drafting against a one-position step; until the
    # drafter has run one (probes only catch up), the step measured at load stands in.
    if state is not None and state.step_s is None:
        state.step_s = model.costs(k).step
    # auto: the cost model decides whether to draft, a stop rule when to stop: DISCO where the pair's
    # classifier was calibrated for this kind of decoding (greedy or sampling; asked for by name, it
    # runs either way), else in greedy decoding the confidence cut.
    disco = model.disco if state is not None else None
    if disco is not None and (name == "disco" or (cfg.schedule is None and disco.greedy == greedy)):
        choice.schedule = DiscoSchedule(cost, disco, names)
    elif cfg.schedule is None and greedy and state is not None:
        choice.schedule = ConfidenceSchedule(cost)
    choice.k = longest
    return choice


def _cost(model: Any, cfg: GenerationConfig, proposers: dict[str, Proposer], k: int, longest: int,
          own: CostSchedule | None) -> Choice:
    """The cost schedule of a reply. Sampling with a seed: the generator's own, planning from fixed
    costs (Model.fixed_costs) and learning acceptance from its own rounds only, so that the same seed
    gives the same output every time (which draws are made depends on the plan). Else borrowed from
    the model, so that what earlier generations learnt (costs, acceptance) carries over, following
    live timings: greedy output is plain decoding's whatever the plan."""
    greedy = cfg.sampling.greedy
    if cfg.seed is not None and not greedy:
        if own is None:
            own = new_cost_schedule(proposers, k, longest, model.fixed_costs(longest), greedy, learn_costs=False)
        else:
            own.rebind(proposers)
        return Choice(own, k, own=own)
    key = (cfg.sampling, k, longest, tuple(proposers))
    schedule = model.borrow_schedule(key)
    if schedule is None:
        schedule = new_cost_schedule(proposers, k, longest, model.costs(longest), greedy, learn_costs=True)
    else:
        schedule.rebind(proposers)
    return Choice(schedule, k, key=key, own=own)


def new_cost_schedule(proposers: dict[str, Proposer], k: int, longest: int, costs: Costs, greedy: bool,
                      learn_costs: bool) -> CostSchedule:
    """A cost schedule starting from the engines' costs (target forwards up to `longest` + 1
    positions), every drafting algorithm at the drafter's step cost, prompt lookup at none (at a
    drafter step a token, a lookup draft would look dearer than a plain step wherever the drafter's
    step costs more than the target's extra positions, and never run to show otherwise)."""
    free = {name for name, p in proposers.items() if p.drafter is None}
    free |= {p.lookup.name for p in proposers.values() if isinstance(p, ChainProposer)}
    drafts = {a: 0.0 if a in free else costs.step for a in estimated(proposers)}
    return CostSchedule(proposers, k, CostModel(costs.target, drafts, costs.position, learn=learn_costs), greedy=greedy,
                        lookup_max=longest)
