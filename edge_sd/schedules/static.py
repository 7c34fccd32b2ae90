"""Schedules that draft one algorithm a fixed way: a static k, or the heuristic's k that grows after
fully accepted rounds and shrinks after others."""

from __future__ import annotations

from edge_sd.algorithms.base import Proposer
from edge_sd.schedules.base import Plan, Round


class StaticSchedule:
    name = "static"

    def __init__(self, proposer: Proposer | None, k: int):
        self.proposer, self.k = proposer, k

    def plan(self, budget: int, open_ended: bool = False) -> Plan:
        return Plan(self.proposer, min(self.k, budget) if self.proposer else 0)

    def observe(self, plan: Plan, r: Round) -> None:
        pass

    def summary(self) -> dict:
        return {}


class HeuristicSchedule(StaticSchedule):
    name = "heuristic"

    def __init__(self, proposer: Proposer | None, k: int, k_max: int):
        super().__init__(proposer, max(1, k))
        self.k_max = k_max

    def observe(self, plan: Plan, r: Round) -> None:
        if r.proposed:
            self.k = min(self.k_max, self.k + 2) if r.accepted == r.proposed else max(1, self.k - 1)
