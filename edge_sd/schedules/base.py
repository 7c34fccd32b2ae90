"""What every schedule plans and observes: a round's plan and what the round did (docs/algorithms.md,
"Choosing per round: `auto`")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from edge_sd.algorithms.base import Proposer, StopRule
from edge_sd.algorithms.chain import ChainProposer


@dataclass
class Plan:
    """A round's proposer and draft length (0 or no proposer: a plain step), the rule that may end a
    drafter's draft sooner (None: it runs to m), and for a chain (lookup+X) how many of its m
    candidates the lookup proposes."""

    proposer: Proposer | None
    m: int
    stop: StopRule | None = None
    lookup: int = 0


@dataclass
class Round:
    """What a round proposed and accepted, and what it cost: its target forward, its drafting (of which
    `catch_up_s` went to catching the drafter up on `caught_up` positions: the draft's own figures),
    and the rest of it (verification, the text, syncing the drafter). accepted_bytes: the bytes the
    accepted candidates spell."""

    proposed: int
    accepted: int
    target_s: float
    draft_s: float = 0.0
    other_s: float = 0.0
    accepted_bytes: int = 0
    catch_up_s: float = 0.0
    caught_up: int = 0


class Schedule(Protocol):
    name: str

    def plan(self, budget: int, open_ended: bool = False) -> Plan:
        """This round's proposer and draft length, at most `budget` (0 when nothing may be drafted).
        open_ended: a stop rule ends each draft (DISCO, the confidence cut), so a schedule that chooses
        the length may let a draft that pays run to its longest."""
        ...

    def observe(self, plan: Plan, r: Round) -> None:
        """What the planned round proposed, accepted and cost."""
        ...

    def summary(self) -> dict:
        """What the schedule did, for the statistics."""
        ...


def estimated(proposers: dict[str, Proposer]) -> list[str]:
    """The algorithms whose acceptance and drafting cost a cost schedule follows: every proposer's,
    a chain's two parts instead of its own (what it proposes is theirs)."""
    names: list[str] = []
    for name, p in proposers.items():
        parts = [p.lookup.name, p.inner.name] if isinstance(p, ChainProposer) else [name]
        names += [a for a in parts if a not in names]
    return names
