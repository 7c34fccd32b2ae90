"""The shared interface of proposers and the drafter's state, kept in sync with the committed text."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_sd.engines.base import Engine
from edge_sd.sampling import Probs
from edge_sd.token_bytes import is_continuation, utf8_complete
from edge_sd.vocab import WINDOW_TOKENS, Vocab

# How fast the estimate of a one-position drafter forward follows new measurements.
STEP_WEIGHT = 0.1
# A draft feeds at most this many positions on its first forward when the last round drafted too (the
# last drafted token and the round's own token): part of what every draft costs, not catching up.
STEADY_PENDING = 2

# (candidates, proposal rows q [m, V] or None, target distributions p [m+1, V], rng) -> (accepted, next)
# Asked after each drafted token (its drafter logits, its position in the draft from 1) whether to
# draft another: DISCO's classifier, the confidence cut, a recorder of calibration traces.
StopRule = Callable[[np.ndarray, int], bool]
Verifier = Callable[[list[int], np.ndarray | None, Probs, np.random.Generator], tuple[int, int]]


@dataclass
class Draft:
    """What a proposer hands the loop for one round.

    candidates: target ids c_1..c_m; -1 stands for SLRS's "none" proposal (never accepted).
    q: [m, V_target] float64 proposal distribution of each candidate given everything before it, or
       None for exact-match verification (SLEM), where the target's own draws decide.
    catch_up_s, caught_up: what the drafter's catching up cost this draft (its first forward beyond a
       one-position step: the prompt, tokens committed during plain steps, a lookup's continuation),
       and the positions that was for; paid once, so the cost schedule keeps it apart.
    """

    candidates: list[int]
    q: np.ndarray | None
    catch_up_s: float = 0.0
    caught_up: int = 0


class Proposer(Protocol):
    name: str

    @property
    def drafter(self) -> DrafterState | None:
        """The drafter state it drafts from; None for a proposer that needs no model (prompt lookup),
        which also tells `available(k)`: how many candidates it has now."""
        ...

    @property
    def verifier(self) -> Verifier:
        """The rule that checks this proposer's candidates under sampling."""
        ...

    def propose(self, k: int, committed: list[int], stop: StopRule | None = None) -> Draft:
        """Up to k candidates continuing the committed target ids; `stop` may end a drafter's draft
        sooner (asked after each drafted token)."""
        ...



def scatter_to_targets(q: np.ndarray, mapping: np.ndarray, width: int) -> np.ndarray:
    """A proposal over target ids from one over drafter ids: every drafter id d with mass hands it to
    mapping[d] (-1: no target id), so drafter ids that share a target id add up. q: [V_d] -> [width]."""
    row = np.zeros(width)
    idx = np.nonzero(q)[0]
    idx = idx[(mapping[idx] >= 0) & (mapping[idx] < width)]
    np.add.at(row, mapping[idx], q[idx])
    return row


class DrafterState:
    """The drafter engine, its token sequence and the KV sync of step 4 in
    docs/algorithms.md, "One round, for every algorithm".

    `ids` is the drafter's sequence: the prompt's drafter tokens, then drafter tokens whose bytes are a
    prefix of the generated text (plus, during a round, drafted tokens). Positions [0, engine.n_cached)
    are in the KV cache; the rest are fed on the next forward.
    """

    def __init__(self, engine: Engine, vocab: Vocab, prompt_ids: list[int], kept: np.ndarray | None = None,
                 heal: bool = False):
        """kept: the drafter id of each logits column of a pruned LM head (None: column i is id i).

        heal: token healing of the prompt's end, for proposers that hand over text (SLEM). A prompt
        cut where the drafter's tokenizer would have merged on (code ending in "\n" before the next
        line's indentation) leaves the drafter after a token it seldom saw there: its first draft was
        rejected after 8 of 8 code prompts. Healing takes the prompt's last token back into the
        generated text (`head`) and makes the first drafted token begin with its bytes; the text after
        them is the draft.
        """
        self.engine = engine
        self.vocab = vocab
        self.kept = kept
        self.ids = list(prompt_ids)
        self.head = b""
        self._head_ids: np.ndarray | None = None
        last = vocab.token_bytes[prompt_ids[-1]] if heal and len(prompt_ids) > 1 else None
        if last:
            allowed = vocab.ids_starting_with(last)
            allowed = allowed if kept is None else np.intersect1d(allowed, kept)
            if len(allowed):  # a pruned head may keep none of them: no healing then
                self.ids.pop()
                self.head, self._head_ids = last, allowed
        self.n_prompt = len(self.ids)
        self.lagging = False  # True while committed bytes exist that the drafter could not take in
        self.ends: list[int] = []  # byte end of each generated-region token known to match the text
        self._last_logits: np.ndarray | None = None
        self._stop: StopRule | None = None  # the stop rule of the draft in progress (set by `budget`)
        self._position = 0
        # This draft's catching up: what a forward that fed more than STEADY_PENDING positions (the
        # prompt, or tokens committed during plain steps) cost beyond a one-position step. That
        # forward also gives the first drafted token, so only the excess is kept apart for the cost
        # schedule, which must predict what a drafted token costs.
        self.catch_up_s = 0.0
        self.caught_up = 0  # the positions that cost was for (beyond one per catching-up forward)
        self.step_s: float | None = None  # a one-position forward: its running mean (early) or EMA

    def budget(self, k: int, stop: StopRule | None = None) -> int:
        """How many tokens may be drafted now: at most k, none past the drafter's maximum context, and
        none while the committed text has bytes the drafter could not take in (see `lagging`). A
        proposer asks it once, as a draft begins, with the draft's stop rule (`keep_drafting`)."""
        self._position = 0
        self._stop = stop
        self.catch_up_s = 0.0
        self.caught_up = 0
        return self.room(k)

    def room(self, k: int) -> int:
        """`budget`'s answer, asking nothing of a draft."""
        return 0 if self.lagging else max(0, min(k, self.engine.manifest.max_context - len(self.ids)))

    def drafting(self, k: int, stop: StopRule | None = None, ask: bool = True) -> Iterator[np.ndarray]:
        """The drafting loop every drafter proposer runs: the drafter's logits [V_d] for each token of a
        draft of up to k (`budget`, asked now). The proposer pushes the token it draws from them before
        it asks for the next, which is when the stop rule is asked about that token (ask=False: the
        proposer asks it itself); it ends the draft sooner by leaving the loop."""
        return self._drafting(self.budget(k, stop), ask)

    def _drafting(self, n: int, ask: bool) -> Iterator[np.ndarray]:
        for _ in range(n):
            logits = self.next_logits()
            yield logits
            if ask and not self.keep_drafting(logits):
                return

    @property
    def behind(self) -> int:
        """Positions the next forward feeds beyond a one-position step when it is catching up (more than
        STEADY_PENDING pending: the prompt, or tokens committed during plain steps), else 0: what
        `catch_up_s` will have measured."""
        return self.behind_after(0)

    def behind_after(self, taken: int) -> int:
        """`behind`, after `taken` more tokens were appended (`take`)."""
        pending = len(self.ids) - self.engine.n_cached + taken
        return pending - 1 if pending > STEADY_PENDING else 0

    def keep_drafting(self, logits: np.ndarray) -> bool:
        """After a drafted token was pushed (drawn from `logits`): whether to draft another."""
        self._position += 1
        return self._stop is None or self._stop(logits, self._position)

    def next_logits(self) -> np.ndarray:
        """Drafter logits [V_d] for the token after `ids`, feeding what is not cached yet. Columns past
        the tokenizer's size (a padded LM head) are dropped: no proposer can pick a padding id. A
        pruned head's logits are spread over drafter ids, -inf where a row was cut: every proposer
        then drafts from the kept tokens alone, with no map of its own."""
        pending = self.ids[self.engine.n_cached :]
        if pending:
            before = self.engine.forward_time  # engines time their own forwards
            out = self.engine.forward(np.asarray(pending), last=1)[-1]
            elapsed = self.engine.forward_time - before
            if self.kept is None:
                self._last_logits = out[: self.vocab.size]
            else:
                self._last_logits = np.full(self.vocab.size, -np.inf, dtype=out.dtype)
                self._last_logits[self.kept] = out[: len(self.kept)]
            if len(pending) == 1:
                self.step_s = elapsed if self.step_s is None else self.step_s + STEP_WEIGHT * (elapsed - self.step_s)
            elif len(pending) > STEADY_PENDING:
                self.catch_up_s += max(0.0, elapsed - (self.step_s or 0.0))
                self.caught_up += len(pending) - 1
        assert self._last_logits is not None, "the drafter has no context to continue"
        if self.healing:
            healed = np.full_like(self._last_logits, -np.inf)
            healed[self._head_ids] = self._last_logits[self._head_ids]
            return healed
        return self._last_logits

    @property
    def healing(self) -> bytes:
        """The bytes the next drafted token must begin with: the healed prompt end, until a token
        covers it (empty when not healing)."""
        return self.head if len(self.ids) == self.n_prompt else b""

    def push(self, d: int) -> None:
        self.ids.append(int(d))

    def draft(self, candidates: list[int], rows: list[np.ndarray] | None) -> Draft:
        """The draft a proposer drafted from this state since `budget`, with what it caught up. rows:
        each candidate's proposal row (q [m, V_t] stacked; None for exact match)."""
        q = np.stack(rows) if rows else None
        return Draft(candidates, q, self.catch_up_s, self.caught_up)

    def take(self, text: bytes) -> bool:
        """Append drafter tokens spelling `text` as if it were committed after the synced text (a
        proposal the drafter is to continue), before a draft; the next sync keeps them where the
        text came true. False, with nothing appended, where they could not line up with the text: the
        drafter lags behind it, `text` ends inside a character, its tokenizer cannot spell it, or it
        would leave no room to draft."""
        if self.lagging or not text or utf8_complete(text) != text or is_continuation(text):
            return False
        ids = self.vocab.encode_bytes(self.healing + text)  # a healed prompt end starts it
        if not ids or len(self.ids) + len(ids) >= self.engine.manifest.max_context:
            return False
        self.ids += ids
        return True

    def sync(self, generated: bytes) -> None:
        """Keep the longest prefix of drafter tokens that still matches the text, re-tokenize a short
        window after it, and cut the KV cache back to what is shared.

        The committed text only grows, so tokens that matched at the last sync still match: the walk
        starts after them, and the cost of a round does not grow with the length of the output.
        """
        generated = self.head + generated  # the healed prompt end is the generated text's start
        tb = self.vocab.token_bytes
        gen = self.ids[self.n_prompt :]
        j = len(self.ends)
        pos = self.ends[-1] if self.ends else 0
        ends = list(self.ends)
        while j < len(gen):
            b = tb[gen[j]] or b""
            if not b or generated[pos : pos + len(b)] != b:
                break
            pos += len(b)
            ends.append(pos)
            j += 1
        w = max(0, j - WINDOW_TOKENS)
        # A window must start on a character boundary to be re-tokenized as text.
        while w > 0 and is_continuation(generated[ends[w - 1] : ends[w - 1] + 1]):
            w -= 1
        start = ends[w - 1] if w > 0 else 0
        window = generated[start:]
        complete = utf8_complete(window)
        new = self.vocab.encode_bytes(complete) if complete else []
        if new is None:  # the drafter tokenizer cannot spell these bytes exactly: keep what matched
            new = gen[w:j]
            complete = generated[start:pos]
        keep = self.n_prompt + w
        old = self.ids[keep:]
        common = 0
        while common < min(len(old), len(new)) and old[common] == new[common]:
            common += 1
        self.ids = self.ids[: keep + common] + list(new[common:])
        self.ends = ends[:w]
        at = start
        for t in new:
            at += len(tb[t] or b"")
            self.ends.append(at)
        if self.engine.n_cached > keep + common:
            self.engine.truncate(keep + common)
        if self.engine.n_cached >= len(self.ids):
            # The logits of the last kept position went with the cut: that position is fed again.
            self.engine.truncate(len(self.ids) - 1)
        self.lagging = start + len(complete) < len(generated)
