"""The cost schedule (`auto`): each round, the draft length and algorithm that maximise expected tokens
per second, from the engines' costs (costs.CostModel) and the acceptance seen so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edge_sd.algorithms.base import Proposer
from edge_sd.algorithms.chain import ChainProposer
from edge_sd.costs import CostModel
from edge_sd.schedules.base import Plan, Round, estimated

# Acceptance estimates start from 0.5 with the weight of PRIOR rounds each side, and forget the past at
# this rate per round, so that they follow the text (code is predictable, a summary's first words less so).
PRIOR = 1.0
DECAY = 0.97
# After this many plain steps in a row, one round drafts PROBE tokens to refresh the estimates; after
# PROBE_EVERY_HOPELESS where not even drafts accepted in full would pay at the measured costs (a
# drafter as slow as the target, as on a GPU where both are launch-bound): there a probe can only
# refresh the costs, and the first one of each generation also pays the drafter's prompt.
PROBE_EVERY = 8
PROBE_EVERY_HOPELESS = 64
PROBE = 1
# A probe whose drafter must first catch up more than a plain step costs (its prompt, at a generation's
# start) is not made, unless this many generations in a row drafted nothing: then one is, so that
# estimates carried from texts where drafts did not pay are put to the test again on a new one (a
# long-lived pipeline would else decode plainly for good after a few poor texts).
PROBE_EVERY_GENERATIONS = 4
# Which algorithm drafts is chosen on optimistic acceptance: each estimate plus this many standard
# errors, so that one seldom tried (or tried long ago: decay shrinks its counts) is tried again, and
# one unlucky early draft does not rule an algorithm out for the rest of the text.
OPTIMISM = 1.0
# A new generation is a new text: the acceptance counts of the ones before it are kept as a prior worth
# at most this many rounds (of the first position), so that a text unlike the last is soon judged on
# its own rounds rather than on the last text's.
CARRY = 4.0



@dataclass
class Acceptance:
    """Per draft position i: how often candidate i was accepted when it was verified (decayed counts)."""

    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def rates(self, k: int, optimism: float = 0.0, explored: int | None = None) -> list[float]:
        """Estimated P(candidate i accepted | candidates before it accepted) for i = 0..k-1.

        Each position's counts are smoothed towards the position before it (the first towards 1/2),
        so that a depth seldom or never drafted takes the estimate of the ones before it instead of
        the prior, and the schedule can find out that longer drafts pay. optimism: add that many
        standard errors of the estimate (its counts' binomial error), to the first `explored`
        positions only where given.
        """
        out, rate, n = [], 0.5, 2 * PRIOR
        for i in range(k):
            if i < len(self.tried):
                n = self.tried[i] + 2 * PRIOR
                rate = (self.accepted[i] + 2 * PRIOR * rate) / n
            hope = optimism if explored is None or i < explored else 0.0
            out.append(min(1.0, rate + hope * (rate * (1 - rate) / n) ** 0.5))
        return out

    def rate(self, i: int, optimism: float = 0.0) -> float:
        """The estimate for candidate i alone (`rates`)."""
        return self.rates(i + 1, optimism)[i]

    def shrink(self, weight: float) -> None:
        """Scale the counts so that the first position's come to at most `weight` rounds."""
        if self.tried and self.tried[0] > weight:
            f = weight / self.tried[0]
            self.accepted = [a * f for a in self.accepted]
            self.tried = [t * f for t in self.tried]

    def decay(self) -> None:
        self.accepted = [a * DECAY for a in self.accepted]
        self.tried = [t * DECAY for t in self.tried]

    def update(self, proposed: int, accepted: int) -> None:
        while len(self.tried) < proposed:
            self.tried.append(0.0)
            self.accepted.append(0.0)
        # Candidates 0..accepted-1 were accepted; candidate `accepted` (if any) was rejected; the
        # ones after it were never verified.
        for i in range(min(proposed, accepted + 1)):
            self.tried[i] += 1.0
            self.accepted[i] += 1.0 if i < accepted else 0.0

    def expect_first(self, p: float) -> None:
        """A first candidate that would have been accepted with probability p (not drafted)."""
        if not self.tried:
            self.tried.append(0.0)
            self.accepted.append(0.0)
        self.tried[0] += 1.0
        self.accepted[0] += p

    def expected_tokens(self, m: int, optimism: float = 0.0) -> float:
        """1 + a_1 + a_1 a_2 + ... + a_1...a_m: the tokens a round with m drafts emits on average."""
        return self.tokens_by_length(m, optimism)[m]

    def tokens_by_length(self, k: int, optimism: float = 0.0, explored: int | None = None) -> list[float]:
        """expected_tokens(m) for m = 0..k, in one pass."""
        return tokens_by_length(self.rates(k, optimism, explored))


def tokens_by_length(rates: list[float]) -> list[float]:
    """The tokens a round emits on average when it drafts m = 0..len(rates) candidates, each accepted
    (given the ones before it were) at its rate: 1 + a_1 + a_1 a_2 + ..."""
    out, run = [1.0], 1.0
    for a in rates:
        run *= a
        out.append(out[-1] + run)
    return out


class CostSchedule:
    """Choose m in 0..K and the algorithm maximising expected tokens per second.

    The costs come from a CostModel (costs.py): a target forward over s positions (calibrated at
    load, then followed online), the drafting cost per drafted token per algorithm as the rounds run
    (the proposer's whole time: drafter forwards, catching up after a sync, its numpy work).

    greedy: the draft length is chosen on optimistic acceptance too (once drafting pays on the plain
    estimates). Greedy drafts agree in runs, so a candidate after an accepted one is accepted far
    more often than the first: judged on the first position, longer drafts never look worth trying,
    and optimism about depths seldom verified finds them. Sampled candidates are accepted about
    equally at every depth, and there it only costs.
    """

    name = "cost"

    def __init__(self, proposers: dict[str, Proposer], k_max: int, costs: CostModel, greedy: bool = False,
                 lookup_max: int | None = None):
        """costs: what rounds cost (with a fixed CostModel the plan depends on the rounds' acceptance
        alone: what a seeded generation needs to be reproducible); its target costs must cover forwards
        of lookup_max + 1 positions. k_max: the longest draft of a proposer that runs the drafter (a
        chain's included); lookup_max: of one that needs no model (prompt lookup), k_max by default."""
        self.k_max = k_max
        self.lookup_max = max(k_max, lookup_max or k_max)
        self.costs = costs
        self.depth_optimism = OPTIMISM if greedy else 0.0
        self.acceptance = {name: Acceptance() for name in estimated(proposers)}
        self.carry = CARRY
        self.rounds: dict[str, int] = {}  # "slem:3" (candidates proposed) / "plain" -> rounds of a generation
        self.idle_generations = -1  # generations in a row that drafted nothing (rebind counts this one)
        self.rebind(proposers)

    def rebind(self, proposers: dict[str, Proposer]) -> None:
        """Start a new generation with new proposers, keeping what the costs and acceptance taught
        (a pipeline keeps one schedule per sampling mode, so each generation starts informed)."""
        self.proposers = proposers
        for acc in self.acceptance.values():
            acc.shrink(self.carry)
        self._algo_of = {id(p): name for name, p in proposers.items()}
        # Proposers that run the drafter, those that need no model (prompt lookup), and chains of the
        # two: only the first and last pay the drafter's catching up and stop at a stop rule.
        self._chains = [a for a, p in proposers.items() if isinstance(p, ChainProposer)]
        self._drafting = [a for a, p in proposers.items() if p.drafter is not None and a not in self._chains]
        self._free = [a for a, p in proposers.items() if p.drafter is None]
        self._state = next((p.drafter for p in proposers.values() if p.drafter is not None), None)
        drafted = any(key != "plain" for key in self.rounds)
        self.idle_generations = 0 if drafted else self.idle_generations + 1
        self.plain_streak = 0
        self.rounds = {}
        self.held_back = 0  # plain steps where drafts paid by the token but not the drafter's catching up

    def _rates(self, algo: str, k: int, optimism: float = 0.0, explored: int | None = None) -> list[float]:
        """Expected tokens per second of rounds drafting m = 1..k tokens with this algorithm ([m - 1]),
        optimistic about the first `explored` candidates where given (`Acceptance.rates`)."""
        tokens = self.acceptance[algo].tokens_by_length(k, optimism, explored)
        draft = self.costs.draft(algo)
        return [tokens[m] / self.costs.round(m, draft) for m in range(1, k + 1)]

    def _could_pay(self, k: int, plain: float) -> bool:
        """Whether some drafter draft of 1..k tokens, every one accepted, would beat a plain step."""
        draft = min(self.costs.draft(a) for a in self._drafting)
        return any((m + 1) / self.costs.round(m, draft) > plain for m in range(1, k + 1))

    def plan(self, budget: int, open_ended: bool = False) -> Plan:
        """open_ended: a stop rule (DISCO) ends each drafter draft, so one that pays may run to the longest.

        The drafter's algorithms are planned first (below); a proposer that needs no model (prompt
        lookup) then takes the round where its continuation, available now, is expected to be faster
        than what was planned; then a chain (lookup+X), where the continuation is shorter than k and
        extending it with the drafter is expected to be faster still."""
        k, free_k = min(self.k_max, budget), min(self.lookup_max, budget)
        plain = 1.0 / self.costs.plain()
        algo, m, rate = self._plan_drafter(k, budget, plain, open_ended) if self._drafting else (None, 0, plain)
        caps: dict[int, int] = {}  # id of a lookup proposer -> its candidates now (chains share the menu's)

        def available(lookup: Proposer) -> int:
            if id(lookup) not in caps:
                caps[id(lookup)] = lookup.available(free_k) if free_k > 0 else 0  # type: ignore[attr-defined]
            return caps[id(lookup)]

        for name in self._free:
            cap = available(self.proposers[name])
            if cap:
                # optimistic, as a drafter's algorithm is chosen: a rejected lookup costs little, and
                # its estimate must follow texts that start or stop repeating themselves. Beyond the
                # drafter's longest draft (k) only on its estimates as they are: there a verification
                # forward rejected early costs several plain steps, and a text worth drafting that
                # far shows it in the depths up to k.
                hopes = self._rates(name, cap, OPTIMISM, explored=k)
                if max(hopes) > rate:
                    depths = self._rates(name, cap, self.depth_optimism, explored=k)
                    algo, m, rate = name, 1 + int(np.argmax(depths)), max(hopes)
        head = 0
        for name in self._chains:
            chain = self.proposers[name]
            assert isinstance(chain, ChainProposer) and self._state is not None
            j = available(chain.lookup) if k > 1 and not self._state.lagging else 0
            if 0 < j < k:
                hopes = self._chain_rates(chain, j, k, OPTIMISM)
                if max(hopes) > rate:
                    depths = self._chain_rates(chain, j, k, self.depth_optimism)
                    extend = k - j if open_ended else 1 + int(np.argmax(depths))
                    algo, m, rate, head = name, j + extend, max(hopes), j
        drafter_drafts = algo is not None and (algo in self._drafting or algo in self._chains)
        self.plain_streak = 0 if drafter_drafts else self.plain_streak + 1
        return Plan(self.proposers[algo] if algo else None, m, lookup=head)

    def _chain_rates(self, chain: ChainProposer, head: int, k: int, optimism: float) -> list[float]:
        """Expected tokens per second of a chain's rounds: the lookup's `head` candidates, then the
        drafter's e = 1..k - head ([e - 1]). The drafter's first forward also feeds the head's
        positions (and any it is behind): catching up paid by this round."""
        assert self._state is not None
        rates = self.acceptance[chain.lookup.name].rates(head, optimism)
        rates += self.acceptance[chain.inner.name].rates(k - head, optimism)
        draft = self.costs.draft(chain.inner.name)
        behind = self._state.behind_after(head)
        tokens = tokens_by_length(rates)
        return [tokens[head + e] / self.costs.extended(head + e, e, draft, behind) for e in range(1, k - head + 1)]

    def _plan_drafter(self, k: int, budget: int, plain: float, open_ended: bool) -> tuple[str | None, int, float]:
        """The drafter's algorithm and draft length (None, 0: a plain step), with the rate it expects."""
        best_algo, best_m, expected = None, 0, plain
        # Positions a draft starting now feeds beyond a steady draft's first forward (one drafter
        # state serves every proposer).
        assert self._state is not None
        behind = self._state.behind
        if k > 0:
            # Whether to draft: on the estimates as they are (a draft that does not pay on them is a
            # plain step). Which algorithm: the best on optimistic estimates, so that the others are
            # tried again now and then; only while drafting pays anyway, so exploring costs little.
            rates = {a: self._rates(a, k) for a in self._drafting}
            drafts = max(max(r) for r in rates.values()) > plain
            # The drafter's catching up is paid once, whatever follows: a draft starts only where the
            # rest of the generation (budget + 1 tokens), drafted at the estimated rate, gains it back,
            # and a probe, which cannot know that, only where it costs no more than a plain step (or
            # after PROBE_EVERY_GENERATIONS generations without a draft): on short generations the
            # drafter's prompt can cost all that drafts gain. The estimates as they are,
            # not greedy decoding's optimistic depths: optimism explores draft lengths, and paying a
            # prompt's catching up on a hope made greedy auto slower than prompt lookup alone where
            # the lookup took most rounds anyway.
            owed = behind * self.costs.catch_up_cost()
            if drafts and owed:
                best = max(max(r) for r in rates.values())
                drafts = owed < (budget + 1) * (1.0 / plain - 1.0 / best)
                self.held_back += not drafts
            affordable = owed <= self.costs.target(1) or self.idle_generations >= PROBE_EVERY_GENERATIONS
            probe = affordable and self.plain_streak >= PROBE_EVERY and (
                self.plain_streak >= PROBE_EVERY_HOPELESS or self._could_pay(k, plain))
            if drafts or probe:  # else a plain step
                longest = k if drafts else min(PROBE, k)
                shortest = 1 if drafts else longest
                best_algo = max(self._drafting, key=lambda a: max(self._rates(a, longest, OPTIMISM)[shortest - 1:]))
                best_m = longest
                if drafts and open_ended:
                    best_m = k  # the stop rule ends it
                elif drafts:
                    depths = self._rates(best_algo, k, self.depth_optimism) if self.depth_optimism else rates[best_algo]
                    best_m = 1 + int(np.argmax(depths))
                # a probe is made whatever it is expected to give: anything faster takes the round
                expected = max(rates[best_algo]) if drafts else 0.0
        return best_algo, best_m, expected

    def plain_step_seen(self, prob: Callable[[int], float]) -> None:
        """A plain sampled step's distribution (`prob`: a token's probability under it). Where prompt
        lookup has a candidate for the position, a lookup draft there would have been accepted with
        that candidate's probability (a proposal made with certainty is accepted with the target's
        probability of it): its expectation counts as a round of lookup's first candidate, decayed as
        drafted rounds are. So lookup's acceptance is learnt from every plain step, not only from
        drafts that cost a verification forward each, which under sampling are often rejected."""
        for name in self._free:
            peek = getattr(self.proposers[name], "peek", None)
            candidate = peek() if peek is not None else None
            if candidate is not None:
                acceptance = self.acceptance[name]
                acceptance.decay()
                acceptance.expect_first(prob(candidate))

    def observe(self, plan: Plan, r: Round) -> None:
        proposed, accepted = r.proposed, r.accepted
        proposer = plan.proposer if proposed else None  # a round that proposed nothing was a plain step
        algo = self._algo_of[id(proposer)] if proposer is not None else None
        key = f"{algo}:{proposed}" if algo is not None else "plain"
        self.rounds[key] = self.rounds.get(key, 0) + 1
        if proposer is None or algo is None:
            self.costs.observe(proposed + 1, r.target_s, r.other_s)
            return
        # A chain's candidates are its parts': the lookup's first, then the drafter's, each learnt as
        # if drafted alone (the drafter's given that the lookup's were accepted); what it spent on
        # drafting is the drafter's.
        parts, drafting, drafted = [(algo, proposed, accepted)], algo, proposed
        if isinstance(proposer, ChainProposer):
            head = min(plan.lookup, proposed)
            parts = [(proposer.lookup.name, head, min(accepted, head))]
            drafting, drafted = proposer.inner.name, proposed - head
            if drafted and accepted >= head:
                parts.append((drafting, drafted, accepted - head))
        self.costs.observe(proposed + 1, r.target_s, r.other_s, drafting, drafted, r.draft_s, r.catch_up_s,
                           r.caught_up)
        # Every algorithm forgets, not only the one that drafted: the counts of one left aside shrink,
        # its optimistic estimate grows, and it is tried again later.
        for acc in self.acceptance.values():
            acc.decay()
        for name, n, a in parts:
            self.acceptance[name].update(n, a)

    def summary(self) -> dict:
        return {
            "rounds": dict(sorted(self.rounds.items())),
            **self.costs.summary(),
            "held_back": self.held_back,
            "idle_generations": self.idle_generations,  # before this one (see PROBE_EVERY_GENERATIONS)
            "acceptance": {a: [round(acc.rate(i), 3) for i in range(len(acc.tried))]
                           for a, acc in self.acceptance.items()},
        }
