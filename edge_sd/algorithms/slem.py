"""SLEM, string-level exact match. The drafter's text is re-tokenized by the target
tokenizer in context; the target's own draws decide, so any candidates are lossless."""

from __future__ import annotations

import numpy as np

from edge_sd.algorithms.base import Draft, DrafterState, StopRule
from edge_sd.sampling import Probs, Rows
from edge_sd.token_bytes import is_continuation, utf8_complete
from edge_sd.vocab import WINDOW_TOKENS, Vocab


def verify_exact(candidates: list[int], q: np.ndarray | None, p: Probs,
                 rng: np.random.Generator) -> tuple[int, int]:
    """Draw the target's own token z_j ~ p_j at each position; accept while z_j == c_j, emit z_j at
    the first mismatch (or z_{m+1}). p: [m+1, V]; q is not used (the target's own draws decide).
    Returns (accepted, next token)."""
    rows = Rows.of(p)
    for i, c in enumerate(candidates):
        z = rows.dist(i).sample(rng)
        if z != c:
            return i, z
    m = len(candidates)
    return m, rows.dist(m).sample(rng)


def target_tail(vocab: Vocab, committed: list[int]) -> list[int]:
    """The last few committed target tokens that have bytes, starting on a character boundary."""
    tail: list[int] = []
    for t in reversed(committed[-WINDOW_TOKENS:]):
        if not vocab.token_bytes[t]:
            break
        tail.append(t)
    tail.reverse()
    while tail and is_continuation(vocab.token_bytes[tail[0]] or b""):
        tail.pop(0)
    return tail


def retokenize(vocab: Vocab, committed: list[int], text: bytes, k: int) -> list[int]:
    """Target ids for `text` continuing the committed tokens, at most k of them.

    Tokenizes tail + text and keeps what follows the tail when the tail comes back unchanged, so that
    merges across the boundary come out as the target would produce them; else `text` alone.
    """
    tail = target_tail(vocab, committed)
    tail_bytes = vocab.ids_bytes(tail)
    joined = tail_bytes + text
    joined = utf8_complete(joined)
    if len(joined) > len(tail_bytes):
        ids = vocab.encode_bytes(joined)
        if ids is not None and ids[: len(tail)] == tail:
            return ids[len(tail) :][:k]
    text = utf8_complete(text)
    if not text or is_continuation(text):
        return []
    ids = vocab.encode_bytes(text)
    return (ids or [])[:k]


class SLEMProposer:
    """Greedy drafting (it matches the target best), then target re-tokenization of the text."""

    name = "slem"
    verifier = staticmethod(verify_exact)

    def __init__(self, drafter: DrafterState, target_vocab: Vocab, drafter_eos: list[int]):
        self.drafter = drafter
        self.target_vocab = target_vocab
        self.drafter_eos = set(drafter_eos)

    def propose(self, k: int, committed: list[int], stop: StopRule | None = None) -> Draft:
        healed = len(self.drafter.healing)  # bytes of the first drafted token that the prompt holds
        text = b""
        drafting = self.drafter.drafting(k, stop)
        k = self.drafter.room(k)
        for logits in drafting:
            d = int(np.argmax(logits))
            if d in self.drafter_eos or not self.drafter.vocab.token_bytes[d]:
                break  # no bytes to match: the target's own EOS comes as a correction or bonus
            self.drafter.push(d)
            text += self.drafter.vocab.token_bytes[d] or b""
        text = text[healed:]
        return self.drafter.draft(retokenize(self.target_vocab, committed, text, k) if text else [], None)
