"""The hot loop: propose, forward, verify, cut the cache, commit (docs/algorithms.md,
"One round, for every algorithm").

Text, stops and streaming live in text_stream.TextStream; the algorithms in algorithms/; which
proposer drafts how far in schedules/. What is left here is the round itself, the same for plain
decoding (no proposer, or nothing drafted) and for every speculative algorithm. A Generator
(generator.py) runs one round per `generate_next_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_sd.algorithms.base import DrafterState
from edge_sd.algorithms.lookup import LookupProposer
from edge_sd.algorithms.standard import verify_greedy, verify_standard
from edge_sd.engines.base import Engine
from edge_sd.engines.consistency import SPLIT_AT
from edge_sd.errors import EdgeSDError
from edge_sd.sampling import Rows, SamplingConfig, chain
from edge_sd.schedules import Round, Schedule
from edge_sd.stats import Stats
from edge_sd.text_stream import TextStream

# Positions a prefill feeds a forward at most: a forward's activations grow with the positions it
# feeds, so chunks bound the memory a long prompt takes, and a server feeds a prompt between other
# requests' rounds a chunk at a time. A multiple of the engines' split (engines/consistency.py), where
# long forwards are cut anyway.
PREFILL_CHUNK = 512
# ... and fewer as the cache grows: a global attention layer scores a chunk's positions against every
# cached one ([chunk x heads, cached + chunk] floats), so chunks halve while chunk x (cached + chunk)
# exceeds this. That bounds a chunk's transient memory at any depth (16 MiB a score tensor for four
# heads) and keeps the scores in the CPU's caches: deep prefills ran faster in the smaller chunks
# (benchmarks/results/context_depth.md).
PREFILL_AREA = 1 << 20


def prefill_stop(cached: int, end: int) -> int:
    """Where the prefill chunk after `cached` positions ends (at most `end`): at the next multiple of
    its size, so that a prompt is cut alike however it is fed (whole, or a slice a call)."""
    chunk = PREFILL_CHUNK
    while chunk > SPLIT_AT and chunk * (cached + chunk) > PREFILL_AREA:
        chunk //= 2
    return min(end, (cached // chunk + 1) * chunk)


@dataclass
class Emitted:
    """One round's output: the target ids it committed and the text that became printable with them."""

    ids: list[int]
    text: str


class Decoder:
    """One generation's rounds over the target engine and the committed ids; each round asks the
    schedule which proposer drafts how many tokens (none: a plain step).

    Invariant between rounds: the target's KV cache holds the committed sequence except its last
    token x_n, which the next round feeds first.
    """

    def __init__(self, target: Engine, cfg: SamplingConfig, rng: np.random.Generator, schedule: Schedule,
                 drafter: DrafterState | None, committed: Sequence[int], stream: TextStream, stats: Stats,
                 readers: Sequence[LookupProposer] = ()):
        """committed: the ids so far (the prompt, and earlier turns); the decoder keeps its own copy and
        hands each round's to `readers`, the proposers that draft from the ids themselves (prompt
        lookup), before the next round is planned."""
        self.target = target
        self.cfg = cfg
        self.rng = rng
        self.schedule = schedule
        self.drafter = drafter  # the state every drafting proposer draws from, synced after each round
        self.committed = list(committed)
        self.readers = readers
        self.stream = stream
        self.stats = stats
        # Logits may be wider than the tokenizer (padded embedding matrices): padding ids never win.
        self.width = target.manifest.scored_ids
        self._drafter0 = self._drafter_counters()
        self._prefill_end: int | None = None  # where the prefill stops: the committed ids, or all but the last
        self._first: Emitted | None = None  # the first token, drawn from the prefill's last row

    def prefill(self, limit: int | None = None) -> bool:
        """Cache what is not cached yet of the committed ids, a chunk a forward (prefill_stop); with
        `limit`, about that many positions now (a chunk at least). True once all of it is cached.

        The last id is fed too where more than it is uncached: the last chunk's last row then gives
        the reply's first token (the next `step` returns it), as llama.cpp and Hugging Face's
        generate take it, so that the first token costs no forward of its own. A reply whose ids
        but the last are cached already (one new id) starts with a round, which feeds it."""
        committed, target = self.committed, self.target
        if self._prefill_end is None:
            n = len(committed)
            # Fixed here, so that a prompt is cut the same way however it is fed, a call at a time or whole.
            self._prefill_end = n if target.n_cached < n - 1 else n - 1
            self.stats.prompt_tokens = n
            self.stats.prefilled_tokens = self._prefill_end - target.n_cached
        end = self._prefill_end
        fed, row = 0, None
        while target.n_cached < end and (limit is None or fed < limit):
            stop = prefill_stop(target.n_cached, end)
            before, n = target.forward_time, target.n_cached  # engines time their own forwards
            row = target.forward(np.asarray(committed[n:stop]), last=1, scratch=True)
            elapsed = target.forward_time - before
            self.stats.prefill_s += elapsed
            self.stats.wall_s += elapsed
            fed += stop - n
        if target.n_cached < end:
            return False
        if end == len(committed):
            assert row is not None  # the call that feeds the last chunk gets here
            self._first = self._first_token(row)
        else:
            self._check()
        return True

    def _first_token(self, row: np.ndarray) -> Emitted:
        """The reply's first token, from the logits of the prompt's last position (read before the
        target's next forward: the engine's scratch buffer)."""
        start = time.perf_counter()
        _, nxt = self._verify(row[:, : self.width], [], verify_standard, None)
        new, text = self._commit([nxt])
        self.stats.prefill_emitted = len(new)
        self.stats.wall_s += time.perf_counter() - start
        return self._emitted(new, text)

    def _check(self) -> None:
        n = len(self.committed) - 1
        cached = self.target.cached_ids
        if self.target.n_cached != n or (n and (cached[-1] != self.committed[n - 1] or cached[0] != self.committed[0])):
            raise EdgeSDError(f"the target's cache holds {self.target.n_cached} positions where the committed "
                              f"sequence but its last token is {n}: two users of one engine?")

    def step(self) -> Emitted:
        """One round: emits 1 + accepted tokens (fewer at a stop), or only the text held back when the
        generation has ended; first, the token the prefill drew, where it drew one. Call while
        `stream.done` is false."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        round_start = time.perf_counter()
        target, stream, committed = self.target, self.stream, self.committed
        max_ctx = target.manifest.max_context
        n = len(committed)
        if n > max_ctx:  # plain decoding emits one token past the last cached position, no more
            return self.finish("context")
        self._check()
        # Never draft past what may be emitted (the round emits one token of its own) nor past the
        # context; nor while the cache is empty (a one-token prompt): that forward has a single
        # position with nothing to re-feed, so plain decoding takes it alone too.
        plan = self.schedule.plan(min(stream.remaining - 1, max_ctx - n) if target.n_cached else 0)
        proposer = plan.proposer if plan.m > 0 else None
        if proposer is not None and proposer.drafter is not None:
            # A drafter whose session is built on first use is built here: the cost schedule learns
            # what a draft costs from its time, which the one-off build would inflate.
            proposer.drafter.engine.prepare()
        start = time.perf_counter()
        draft = proposer.propose(plan.m, committed, plan.stop) if proposer is not None else None
        draft_s = time.perf_counter() - start
        # -1 is a proposal with no target id (never accepted); so is an id past the logits.
        cands = [c if c < self.width else -1 for c in draft.candidates[: plan.m]] if draft else []
        before = target.forward_time
        # Read within the round, before the target's next forward: the engine's scratch buffer.
        fed = np.asarray([committed[-1]] + [max(c, 0) for c in cands])
        logits = target.forward(fed, scratch=True)[:, : self.width]
        target_s = target.forward_time - before  # logits: [m+1, V]
        verifier = plan.proposer.verifier if plan.proposer else verify_standard
        q = draft.q[: len(cands)] if draft is not None and draft.q is not None else None
        a, nxt = self._verify(logits, cands, verifier, q)
        target.truncate(n + a)  # keeps x_n and the accepted candidates; nxt is fed next round
        self.stats.count_round(len(cands), a, target_s)
        new, text = self._commit(cands[:a] + [nxt])
        rest_s = time.perf_counter() - round_start - target_s - draft_s
        caught = (draft.catch_up_s, draft.caught_up) if draft is not None else (0.0, 0)
        self.schedule.observe(plan, Round(len(cands), a, target_s, draft_s, rest_s,
                                          len(stream.vocab.ids_bytes(cands[:a])), *caught))
        self.stats.wall_s += time.perf_counter() - round_start
        return self._emitted(new, text)

    def _verify(self, logits: np.ndarray, cands: list[int], verifier, q: np.ndarray | None) -> tuple[int, int]:
        """(candidates accepted, the token after them) from the target's logits over x_n and the
        candidates; no candidates: a plain step."""
        # Row i's penalties count the committed tokens and the candidates before it.
        rows = Rows(logits, self.cfg, self.cfg.window(self.committed), cands)
        if self.cfg.greedy:  # every algorithm's rule reduces to: accept while c_i == argmax p_i
            return verify_greedy(cands, rows.penalized() if self.cfg.penalized else logits)
        if not cands:  # a plain sampled step
            dist = chain(logits[0], self.cfg, rows.history)
            seen = getattr(self.schedule, "plain_step_seen", None)
            if seen is not None:  # what a lookup draft would have had accepted here, at no cost
                seen(dist.prob)
            return 0, dist.sample(self.rng)
        return verifier(cands, q, rows, self.rng)

    def _commit(self, tokens: list[int]) -> tuple[list[int], str]:
        """Push tokens through the stream (up to a stop); the ids committed go to the proposers that
        read them, and their text to the drafter."""
        new, text = self.stream.push(tokens)
        self.committed += new
        for reader in self.readers:
            reader.follow(self.committed)
        if self.drafter is not None and not self.stream.done:
            self.drafter.sync(self.stream.generated)
        return new, text

    def _emitted(self, new: list[int], text: str) -> Emitted:
        if self.stream.done:
            return Emitted(new, text + self.finish("context").text)
        return Emitted(new, text)

    def finish(self, reason: str) -> Emitted:
        """End the generation (unless it has ended: its reason stands) and return the text held back;
        the statistics are complete from here on."""
        started = time.perf_counter()
        tail = self.stream.finish(reason)
        s = self.stats
        s.stop_reason = self.stream.reason
        s.new_tokens = len(self.stream.ids)
        s.schedule = self.schedule.summary()
        time0, calls0 = self._drafter0
        drafter_time, drafter_calls = self._drafter_counters()
        s.time_drafter_s = drafter_time - time0
        s.drafter_forwards = drafter_calls - calls0
        s.wall_s += time.perf_counter() - started
        return Emitted([], tail)

    def _drafter_counters(self) -> tuple[float, int]:
        """The drafter engine's running forward time and count (0 without a drafter)."""
        if self.drafter is None:
            return 0.0, 0
        return self.drafter.engine.forward_time, self.drafter.engine.forward_count
