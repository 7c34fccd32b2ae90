"""Prompt lookup's continuation extended by the drafter: the text's own repetition first, then the
drafter's draft continuing it, in one round.

The lookup's candidates are point masses; the drafter's are whatever its algorithm proposes, given the text
with those candidates in it. Verification is position by position, so each position may have a proposal of its
own: under sampling a point mass is a one-hot row of q, which the speculative sampling rule
(docs/algorithms.md, "The verification rules") verifies exactly as `verify_point` does (accept with p(c), else
p without c), and SLEM's exact match accepts any candidate with p(c) too. So the chain takes the drafting
algorithm's verifier whole.

With no match, the drafter drafts alone; a named `lookup+X` is then X with lookup first.
"""

from __future__ import annotations

import numpy as np

from edge_sd.algorithms.base import Draft, DrafterState, Proposer, StopRule, Verifier
from edge_sd.algorithms.lookup import LookupProposer
from edge_sd.algorithms.slem import verify_exact
from edge_sd.vocab import Vocab


class ChainProposer:
    """lookup's candidates (all it has, up to k), then the inner proposer's for the rest of k."""

    def __init__(self, lookup: LookupProposer, inner: Proposer, target_vocab: Vocab, width: int):
        """width: the target ids a proposal row covers (the inner proposer's rows)."""
        self.lookup, self.inner = lookup, inner
        self.name = f"lookup+{inner.name}"
        self.target_vocab = target_vocab
        self.width = width
        self.exact = inner.verifier is verify_exact  # SLEM's rule reads no q

    @property
    def drafter(self) -> DrafterState | None:
        return self.inner.drafter

    @property
    def verifier(self) -> Verifier:
        return self.inner.verifier

    def available(self, k: int) -> int:
        """How many of a draft of k the lookup would propose now."""
        return self.lookup.available(k)

    def propose(self, k: int, committed: list[int], stop: StopRule | None = None) -> Draft:
        head = self.lookup.propose(k, committed).candidates
        tail = Draft([], None)
        if len(head) < k and self.drafter is not None and self._continues(head):
            tail = self.inner.propose(k - len(head), committed + head, stop)
        cands = head + tail.candidates[: k - len(head)]
        rows = None if self.exact else self._points(head)
        if rows is not None and tail.q is not None:
            rows = np.concatenate([rows, tail.q[: len(cands) - len(head)]])
        return Draft(cands, rows, tail.catch_up_s, tail.caught_up)

    def _continues(self, head: list[int]) -> bool:
        """Whether the drafter may draft after the head: with no head, yes; else where every head token
        has bytes (no special token) and the drafter took their text in."""
        if not head:
            return True
        tb = self.target_vocab.token_bytes
        assert self.drafter is not None
        return all(tb[t] for t in head) and self.drafter.take(self.target_vocab.ids_bytes(head))

    def _points(self, cands: list[int]) -> np.ndarray:
        """One-hot proposal rows (an id past the rows stays all zero: never accepted)."""
        rows = np.zeros((len(cands), self.width))
        for i, c in enumerate(cands):
            if 0 <= c < self.width:
                rows[i, c] = 1.0
        return rows
