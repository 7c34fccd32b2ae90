"""Drafter-free proposals: prompt lookup (n-gram matching on the text itself, in target ids).

The candidates are what followed the most recent earlier occurrence of the text's last n tokens
(n = NGRAM_MAX down to NGRAM_MIN, longest first), in the prompt or the generated text: a summary
quoting its article, code repeating a name, a list continuing its pattern. transformers'
`prompt_lookup_num_tokens`, vLLM's n-gram speculation and llama.cpp's n-gram drafting propose the same.

The proposal is deterministic given the past (q is a point mass on each candidate), so verification
is speculative sampling with q one-hot: accept c with probability p(c), else emit a sample of p with
c removed and renormalised (the residual of a point mass). Greedy, that is: accept while c is the
argmax. Drafting costs no model forward: a dictionary lookup per round.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edge_sd.algorithms.base import Draft, StopRule
from edge_sd.sampling import Probs, Rows

# Longest and shortest suffix matched: longer matches are tried first (they predict better); single
# tokens match almost anywhere and predict little.
NGRAM_MAX = 4
NGRAM_MIN = 2


def verify_point(candidates: list[int], q: np.ndarray | None, p: Probs,
                 rng: np.random.Generator) -> tuple[int, int]:
    """Speculative sampling of deterministic proposals: accept c_i with probability p_i(c_i); at the
    first rejection emit a sample of p_i without c_i (renormalised); if all pass, a sample of p_{m+1}.
    p: [m+1, V]; q is not used (each proposal is a point mass). Returns (accepted, next token)."""
    rows = Rows.of(p)
    for i, c in enumerate(candidates):
        if c >= 0 and rng.random() < rows.dist(i).prob(c):
            continue
        # p(c) = 1 was accepted above (rng.random() < 1), so a rejection leaves mass elsewhere.
        return i, rows.dist(i).sample_without(c, rng)
    m = len(candidates)
    return m, rows.dist(m).sample(rng)


class LookupProposer:
    """Proposes the continuation of the longest recent n-gram match in `history`, its own copy of the
    committed target ids (the prompt, then the generated tokens), brought up to date by `follow`:
    the decoder hands it the committed ids after every round, `propose` those it is given."""

    name = "lookup"
    verifier = staticmethod(verify_point)
    drafter = None  # no model: nothing to catch up, nothing to sync

    def __init__(self, history: Sequence[int]):
        self.history = list(history)
        # (n-gram) -> the position just after its latest occurrence, for every n-gram that has a
        # continuation (its last token is not the history's last).
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this position are in the table

    def _index(self) -> None:
        h = self.history
        for end in range(max(self._indexed, 1), len(h)):  # n-grams h[end-n:end], continued by h[end]
            for n in range(NGRAM_MIN, NGRAM_MAX + 1):
                if end - n >= 0:
                    self._next[tuple(h[end - n : end])] = end
        self._indexed = max(self._indexed, len(h))

    def follow(self, committed: Sequence[int]) -> None:
        """Take in the committed ids: those past the history's end where they continue it (a round's,
        checked at the last one the history holds), else all of them anew (a sequence cut back)."""
        h, n = self.history, len(self.history)
        if len(committed) == n and (not n or committed[-1] == h[-1]):
            return
        if len(committed) > n and (not n or committed[n - 1] == h[-1]):
            h += committed[n:]
            return
        self.history = list(committed)
        self._next.clear()
        self._indexed = 0

    def available(self, k: int) -> int:
        """How many candidates a draft of up to k would propose now (0: no match)."""
        return len(self._continuation(k))

    def peek(self) -> int | None:
        """The candidate a draft of one would propose now (None: no match)."""
        found = self._continuation(1)
        return found[0] if found else None

    def _continuation(self, k: int) -> list[int]:
        self._index()
        h = self.history
        for n in range(NGRAM_MAX, NGRAM_MIN - 1, -1):
            if len(h) > n:
                at = self._next.get(tuple(h[-n:]))
                if at is not None:
                    return h[at : at + k]
        return []

    def propose(self, k: int, committed: list[int], stop: StopRule | None = None) -> Draft:
        """The continuation whole: it was found at no cost, so no stop rule shortens it."""
        self.follow(committed)
        return Draft(self._continuation(k), None)
