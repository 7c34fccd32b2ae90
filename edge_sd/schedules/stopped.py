"""Stop rules on top of another schedule: the inner one decides whether and how far to draft, the rule
ends a drafter's draft sooner (DISCO's classifier, the confidence cut)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from edge_sd.algorithms.base import StopRule
from edge_sd.disco import RECENT_WEIGHT, DiscoModel, token_features
from edge_sd.schedules.base import Plan, Round, Schedule

# The confidence cut stops a draft after a token whose drafter top probability was below this.
CONFIDENCE = 0.5


class ConfidenceCut:
    """A stop rule: a draft ends after a token drawn where the drafter's top probability (at
    temperature 1) was below the threshold."""

    def __init__(self, threshold: float = CONFIDENCE):
        self.threshold = threshold
        self.stopped = 0

    def __call__(self, logits: np.ndarray, position: int) -> bool:
        keep = bool(token_features(logits, position, 0.0, "")[0] >= self.threshold)
        self.stopped += not keep
        return keep

    def summary(self) -> dict:
        return {"confidence": {"threshold": self.threshold, "stopped_early": self.stopped}}


class StoppedSchedule:
    """A stop rule on top of another schedule: the inner one decides whether to draft, with which
    algorithm and how far at most (a static k; on the cost model, its longest draft); the rule, which
    its plans carry, ends the draft."""

    name = "stopped"

    def __init__(self, inner: Schedule, stop: StopRule):
        self.inner = inner
        self.stop = stop

    def plan(self, budget: int, open_ended: bool = False) -> Plan:
        # On the cost model, the cost model decides whether a draft starts, the stop rule when it ends:
        # DISCO's threshold was fitted on tokens per second at calibration, and overriding it with the
        # cost model's marginal test (or capping drafts at the cost model's length) ran slower side by
        # side on held-out prompts.
        return replace(self.inner.plan(budget, open_ended=True), stop=self.stop)

    def observe(self, plan: Plan, r: Round) -> None:
        self.inner.observe(plan, r)

    def plain_step_seen(self, prob: Callable[[int], float]) -> None:
        seen = getattr(self.inner, "plain_step_seen", None)
        if seen is not None:
            seen(prob)

    def summary(self) -> dict:
        return self.inner.summary()


class DiscoSchedule(StoppedSchedule):
    """DISCO on top of another schedule: the classifier stops a draft after any drafted token whose
    predicted acceptance falls below the calibrated threshold."""

    name = "disco"

    def __init__(self, inner: Schedule, model: DiscoModel, names: dict[int, str]):
        super().__init__(inner, self._keep_drafting)
        self.model, self.names = model, names
        self.recent = 0.5
        self.algo = ""
        self.stopped = 0

    def _keep_drafting(self, logits: np.ndarray, position: int) -> bool:
        keep = self.model.prob(token_features(logits, position, self.recent, self.algo)) >= self.model.threshold
        self.stopped += not keep
        return keep

    def plan(self, budget: int, open_ended: bool = False) -> Plan:
        plan = super().plan(budget)
        self.algo = self.names.get(id(plan.proposer), "")
        return plan

    def observe(self, plan: Plan, r: Round) -> None:
        if r.proposed:
            self.recent += RECENT_WEIGHT * (r.accepted / r.proposed - self.recent)
        super().observe(plan, r)

    def summary(self) -> dict:
        return {**self.inner.summary(), "disco": {"threshold": self.model.threshold, "stopped_early": self.stopped}}


class ConfidenceSchedule(StoppedSchedule):
    """The confidence cut on top of another schedule: on a static k (`-s confidence`), or on the cost
    model, auto's greedy schedule on a pair with no DISCO classifier calibrated for greedy decoding
    (it ran faster side by side than drafts ended by the cost model's own marginal test)."""

    name = "confidence"

    def __init__(self, inner: Schedule, threshold: float = CONFIDENCE):
        self.cut = ConfidenceCut(threshold)
        super().__init__(inner, self.cut)

    def summary(self) -> dict:
        return {**self.inner.summary(), **self.cut.summary()}
