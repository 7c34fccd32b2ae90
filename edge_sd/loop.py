"""The hot loop: propose, forward, verify, cut the cache, commit (ALGORITHMS.md section 0).

Text, stops and streaming live in text_stream.TextStream; the algorithms in algorithms/. What is left
here is the round itself, the same for plain decoding (no proposer, or nothing drafted) and for every
speculative algorithm.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edge_sd.algorithms.base import DrafterState
from edge_sd.algorithms.standard import verify_greedy, verify_standard
from edge_sd.engines.base import Engine
from edge_sd.lookahead import Schedule, StaticSchedule
from edge_sd.sampling import SamplingConfig, warp
from edge_sd.stats import Stats
from edge_sd.text_stream import TextStream


@dataclass
class Emitted:
    """One round's output: the target ids it committed and the text that became printable with them."""

    ids: list[int]
    text: str


class Decoder:
    """Owns the target engine and the committed ids; each round asks the schedule which proposer
    drafts how many tokens (none: a plain step). Without a drafter it is plain decoding.

    The target's KV cache always holds the committed sequence except its last token x_n.
    """

    def __init__(self, target: Engine, cfg: SamplingConfig, rng: np.random.Generator,
                 schedule: Schedule | None = None, drafter: DrafterState | None = None):
        self.target = target
        self.cfg = cfg
        self.rng = rng
        self.schedule = schedule or StaticSchedule(None, 0)
        self.drafter = drafter  # the state every proposer drafts from, synced after each round
        # Logits may be wider than the tokenizer (padded embedding matrices): padding ids never win.
        self.width = min(target.manifest.logits_width, target.manifest.vocab_size)

    def run(self, committed: list[int], stream: TextStream, stats: Stats) -> Iterator[Emitted]:
        """committed: the prompt's ids, extended in place with every committed token (a proposer that
        drafts from the text itself, prompt lookup, reads the same list)."""
        t0 = time.perf_counter()
        target, max_ctx = self.target, self.target.manifest.max_context
        self._prefill(committed, stats)
        drafter_time0, drafter_calls0 = self._drafter_counters()
        while not stream.done:
            round_start = time.perf_counter()
            n = len(committed)
            if n > max_ctx:  # plain decoding emits one token past the last cached position, no more
                break
            # Never draft past what may be emitted (the round emits one token of its own) nor past
            # the context; nor while the cache is empty (a one-token prompt): that forward has a
            # single position with nothing to re-feed, so plain decoding takes it alone too.
            plan = self.schedule.plan(min(stream.remaining - 1, max_ctx - n) if target.n_cached else 0)
            start = time.perf_counter()
            draft = plan.proposer.propose(plan.m, committed) if (plan.proposer and plan.m > 0) else None
            draft_s = time.perf_counter() - start
            # -1 is a proposal with no target id (never accepted); so is an id past the logits.
            cands = [c if c < self.width else -1 for c in draft.candidates[: plan.m]] if draft else []
            start = time.perf_counter()
            logits = target.forward(np.asarray([committed[-1]] + [max(c, 0) for c in cands]))[:, : self.width]
            target_s = time.perf_counter() - start  # logits: [m+1, V]
            if self.cfg.greedy:  # every algorithm's rule reduces to: accept while c_i == argmax p_i
                a, nxt = verify_greedy(cands, logits)
            else:
                verify = plan.proposer.verifier if (plan.proposer and cands) else verify_standard
                q = draft.q[: len(cands)] if draft is not None and draft.q is not None else None
                a, nxt = verify(cands, q, warp(logits, self.cfg), self.rng)
            target.truncate(n + a)  # keeps x_n and the accepted candidates; nxt is fed next round
            stats.count_round(len(cands), a, target_s)
            new, text = stream.push(cands[:a] + [nxt])
            committed += new
            rest_s = time.perf_counter() - round_start - target_s - draft_s
            if new or text:
                yield Emitted(new, text)  # the consumer's time is not the round's
            start = time.perf_counter()
            if self.drafter is not None and not stream.done:
                self.drafter.sync(stream.generated)
            rest_s += time.perf_counter() - start
            self.schedule.observe(plan, len(cands), a, target_s, draft_s, len(stream.vocab.ids_bytes(cands[:a])),
                                  rest_s)
        tail = stream.finish("context")
        if tail:
            yield Emitted([], tail)
        stats.stop_reason = stream.reason
        stats.new_tokens = len(stream.ids)
        stats.schedule = self.schedule.summary()
        drafter_time, drafter_calls = self._drafter_counters()
        stats.time_drafter_s = drafter_time - drafter_time0
        stats.drafter_forwards = drafter_calls - drafter_calls0
        stats.wall_s = time.perf_counter() - t0

    def _prefill(self, committed: list[int], stats: Stats) -> None:
        """Cache everything but the last prompt token x_n (the first round feeds it)."""
        self.target.reset()
        stats.prompt_tokens = len(committed)
        if len(committed) > 1:
            start = time.perf_counter()
            self.target.forward(np.asarray(committed[:-1]), last=1)  # its logits are not read
            stats.prefill_s = time.perf_counter() - start

    def _drafter_counters(self) -> tuple[float, int]:
        """The drafter engine's running forward time and count (0 without a drafter)."""
        engine = self.drafter.engine if self.drafter is not None else None
        return getattr(engine, "forward_time", 0.0), getattr(engine, "forward_count", 0)
