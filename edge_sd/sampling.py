"""The sampler chain and sampling (probabilities in float64). Naming: `p` is the target's
distribution, `q` the drafter's.

The chain, in Hugging Face's and vLLM's order (llama.cpp's with `--samplers
"penalties;temperature;top_k;top_p;min_p"`): penalties over the last `repeat_last_n` tokens of the
sequence, temperature, top-k, top-p, min-p. Every filter keeps a prefix of the tokens sorted by
probability (ties by id), so the chain works on candidates: top-k's or min-p's survivors are found
without sorting the row, and only they are sorted. Plain decoding and every verifier read the same
`chain`, which is what makes speculation lossless under it; `warp` gives its dense rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """The user's sampling settings. temperature 0 means greedy (ties go to the lowest id; penalties
    still apply). top_k 0, top_p 1 and min_p 0 are off; a repetition penalty of 1 and presence and
    frequency penalties of 0 are off. repeat_last_n: the penalties' window, the last N tokens of the
    sequence (prompt included, as llama.cpp counts them); -1 is the whole sequence, 0 turns them off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def window(self, history: Sequence[int]) -> Sequence[int]:
        """The tokens the penalties count: the last repeat_last_n of `history`."""
        if not self.penalized:
            return ()
        return history if self.repeat_last_n < 0 else history[-self.repeat_last_n :]


def penalize(logits: np.ndarray, cfg: SamplingConfig, window: Sequence[int]) -> np.ndarray:
    """The logits [V] after the penalties for the tokens in `window`, as llama.cpp applies them: the
    repetition penalty divides a positive logit and multiplies a negative one (Hugging Face's rule),
    then each token loses count * frequency_penalty + presence_penalty (the OpenAI API's rule). A
    float32 copy where anything changes, else the logits themselves."""
    x = np.asarray(logits, dtype=np.float32)
    if not cfg.penalized or not len(window):
        return x
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    inside = (ids >= 0) & (ids < len(x))
    ids, counts = ids[inside], counts[inside]
    x = x.copy()
    v = x[ids]
    if cfg.repetition_penalty != 1.0:
        rp = np.float32(cfg.repetition_penalty)
        v = np.where(v > 0, v / rp, v * rp)
    v -= (counts * cfg.frequency_penalty + cfg.presence_penalty).astype(np.float32)
    x[ids] = v
    return x


class Dist:
    """One position's distribution after the chain: weights over `ids` (None: over every id, the
    unfiltered row) that sum to `total`. Filtered, it holds only the survivors (tens, not 262k), so
    reading, sampling and correcting it cost next to nothing."""

    __slots__ = ("ids", "weights", "total", "_where")

    def __init__(self, ids: np.ndarray | None, weights: np.ndarray, total: float):
        self.ids, self.weights, self.total = ids, weights, float(total)
        self._where: dict[int, int] | None = None

    def prob(self, c: int) -> float:
        if self.ids is None:
            return float(self.weights[c]) / self.total if 0 <= c < len(self.weights) else 0.0
        if self._where is None:
            self._where = {int(t): i for i, t in enumerate(self.ids)}
        i = self._where.get(int(c))
        return 0.0 if i is None else float(self.weights[i]) / self.total

    def dense(self, width: int) -> np.ndarray:
        """The probabilities over ids [0, width) as float64 (width: at least every id held)."""
        if self.ids is None:
            return self.weights.astype(np.float64) / self.total
        out = np.zeros(width)
        out[self.ids] = self.weights / self.total
        return out

    def sample(self, rng: np.random.Generator) -> int:
        i = sample(self.weights, rng)
        return i if self.ids is None else int(self.ids[i])

    def sample_without(self, c: int, rng: np.random.Generator) -> int:
        """A draw from the distribution with c removed and renormalised (c must leave mass elsewhere)."""
        w = self.weights.astype(np.float64, copy=True)
        if self.ids is None:
            if 0 <= c < len(w):
                w[c] = 0.0
            return sample(w, rng)
        w[self.ids == c] = 0.0
        return int(self.ids[sample(w, rng)])

    def sample_residual(self, q: np.ndarray, rng: np.random.Generator) -> int:
        """A draw from norm(max(0, p - q)), q dense [>= every id]: its mass lies where p does."""
        if self.ids is None:
            return sample(residual(self.dense(len(self.weights)), q[: len(self.weights)]), rng)
        p = self.weights / self.total
        r = np.maximum(p - q[self.ids], 0.0)
        return int(self.ids[sample(r if r.sum() > 0 else p, rng)])


def chain(logits: np.ndarray, cfg: SamplingConfig, window: Sequence[int] = ()) -> Dist:
    """One position's sampled distribution (temperature > 0): the chain applied to logits [V], the
    penalties counting `window` (cfg.window of the tokens before this position)."""
    x = penalize(logits, cfg, window)
    t = np.float32(cfg.temperature)
    top_k = 0 < cfg.top_k < len(x)  # a k of the whole vocabulary filters nothing
    if not (top_k or cfg.top_p < 1.0 or cfg.min_p > 0.0):
        w = _weights(x, t)
        return Dist(None, w, w.sum(dtype=np.float64))
    if top_k:
        ids = _top_k(x, cfg.top_k)
        w = _weights(x[ids], t)
        total = w.sum(dtype=np.float64)  # top-p's mass is over top-k's survivors
    elif cfg.top_p < 1.0:
        w_all = _weights(x, t)  # top-p's mass is over every id
        total = w_all.sum(dtype=np.float64)
        return _nucleus(w_all, None, total, cfg)
    else:
        # min-p alone: a survivor's weight exp(x/t - max) is at least min_p, so its logit is within
        # about t * ln(1/min_p) of the top; the exact test is on the weights below.
        top = x.max()
        ids = np.flatnonzero(x >= top + cfg.temperature * (math.log(cfg.min_p) - 0.01))
        w = _weights(x[ids], t, x_max=top)
        total = w.sum(dtype=np.float64)
    return _nucleus(w, ids, total, cfg)


def _nucleus(w: np.ndarray, ids: np.ndarray | None, total: float, cfg: SamplingConfig) -> Dist:
    """Top-p and min-p over weights w of candidates `ids` (None: every id) whose top-p mass is
    `total`. Both keep a prefix of the candidates sorted by weight (ties by id), so only those that
    may survive are sorted: with min-p, the ids of weight at least min_p; else ids above a falling
    threshold, until the kept prefix ends inside them."""
    if ids is not None:
        return _prefix(w, ids, total, cfg)[0]
    for threshold in (cfg.min_p,) if cfg.min_p > 0.0 else (2.0**-7, 2.0**-14, 2.0**-24, 0.0):
        at = np.flatnonzero(w >= threshold) if threshold else np.arange(len(w))
        dist, cut = _prefix(w[at], at, total, cfg)
        if cut or threshold == cfg.min_p or len(at) == len(w):
            return dist
    raise AssertionError("unreachable: the last threshold takes every id")


def _prefix(w: np.ndarray, ids: np.ndarray, total: float, cfg: SamplingConfig) -> tuple[Dist, bool]:
    """The candidates (weights w of `ids`, ascending) that top-p and min-p keep, and whether they cut
    any (else the kept prefix may go on past these candidates)."""
    order = np.argsort(-w, kind="stable")  # ids come in ascending, so ties stay by id
    sw = w[order].astype(np.float64)
    keep = np.ones(len(sw), dtype=bool)
    if cfg.top_p < 1.0:
        p = sw / total
        keep = (np.cumsum(p) - p) < cfg.top_p  # the mass before a token is below top_p
    if cfg.min_p > 0.0:
        keep &= sw >= cfg.min_p * sw[0]  # at least min_p of the most likely token
    kept = sw[keep]
    return Dist(ids[order][keep], kept, kept.sum()), not keep.all()


def _weights(x: np.ndarray, t: np.float32, x_max: np.float32 | None = None) -> np.ndarray:
    """exp(x / t - max(x) / t) in float32 (the logits' own precision; numpy vectorises it), one new
    array; x_max: the max of the whole row when x holds only some of it. [n] -> float32 [n]."""
    top = x.max() if x_max is None else x_max
    if t == 1.0:  # x / 1 is x: one pass fewer
        y = x - top
    else:
        y = x / t
        y -= top / t
    np.exp(y, out=y)
    return y


# Top-k finds its k-th largest logit among the maxima of blocks of this many entries: the k-th largest
# block maximum bounds it from below, so a comparison over the row leaves a few times k candidates
# to partition instead of the whole vocabulary.
TOP_K_BLOCK = 1024


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The ids (ascending) of logits at least the k-th largest (ties at it all kept, as Hugging Face
    keeps them). x: [V], 0 < k < V."""
    n = len(x)
    block = TOP_K_BLOCK
    while n // block < k and block > 8:
        block //= 2
    whole = n - n % block
    if whole // block >= k:
        maxima = x[:whole].reshape(-1, block).max(axis=1)
        bound = np.partition(maxima, len(maxima) - k)[len(maxima) - k]
        cand = np.flatnonzero(x >= bound)
    else:
        cand = np.arange(n)
    v = x[cand]
    kth = np.partition(v, len(v) - k)[len(v) - k]
    return cand[v >= kth]


def warp(logits: np.ndarray, cfg: SamplingConfig, window: Sequence[int] = ()) -> np.ndarray:
    """Dense probabilities after the chain. logits: [..., V] -> float64 [..., V] (each row with the
    same window). Greedy gives a one-hot at the (penalized) argmax, so that every verifier's general
    rule reduces to exact match."""
    logits = np.asarray(logits)
    if logits.ndim > 1:
        return np.stack([warp(row, cfg, window) for row in logits])
    n = logits.shape[-1]
    if cfg.greedy:
        out = np.zeros(n)
        out[int(np.argmax(penalize(logits, cfg, window)))] = 1.0
        return out
    return chain(logits, cfg, window).dense(n)


def draw(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator, window: Sequence[int] = ()) -> int:
    """One draw from the chain's distribution for one position [V] (sampled, not greedy)."""
    return chain(logits, cfg, window).sample(rng)


class Rows:
    """The target's distributions p_1..p_{m+1} of one round, each made from logits [m+1, V] when a
    verifier first reads it: a round that rejects its first proposal reads one or two rows of m+1.
    Row i's penalties count the committed tokens and the candidates before it (plain decoding would
    have committed them first). Built from probabilities [m+1, V] instead (`Rows.of`), it serves
    verifiers their rows as given."""

    def __init__(self, logits: np.ndarray, cfg: SamplingConfig, history: Sequence[int] = (),
                 candidates: Sequence[int] = ()):
        self.logits, self.cfg = logits, cfg
        self.history, self.candidates = history, candidates
        self._rows: dict[int, Dist] = {}
        self._probs: np.ndarray | None = None

    @classmethod
    def of(cls, p: Probs) -> Rows:
        """Rows serving given probabilities [m+1, V] (or Rows as they are)."""
        if isinstance(p, Rows):
            return p
        rows = cls(p, SamplingConfig(1.0))
        rows._probs = np.asarray(p, dtype=np.float64)
        return rows

    def window(self, i: int) -> Sequence[int]:
        """The tokens row i's penalties count."""
        if not self.cfg.penalized:
            return ()
        before = [c for c in self.candidates[:i] if c >= 0]
        return self.cfg.window(list(self.history) + before if before else self.history)

    def dist(self, i: int) -> Dist:
        if i not in self._rows:
            if self._probs is not None:
                self._rows[i] = Dist(None, self._probs[i], self._probs[i].sum())
            else:
                self._rows[i] = chain(self.logits[i], self.cfg, self.window(i))
        return self._rows[i]

    def penalized(self) -> np.ndarray:
        """Every row's logits after its penalties [m+1, V]: greedy decoding takes their argmax."""
        return np.stack([penalize(self.logits[i], self.cfg, self.window(i)) for i in range(len(self.logits))])

    def __getitem__(self, key: int | tuple[int, int]) -> np.ndarray | float:
        """p[i]: row i dense [V] (float64); p[i, c]: its probability of c."""
        i, c = key if isinstance(key, tuple) else (key, None)
        if c is None:
            return self.dist(i).dense(self.logits.shape[-1])
        return self.dist(i).prob(c)


# What verifiers read p from: an array [m+1, V] of probabilities, or Rows made from logits.
Probs = np.ndarray | Rows


# sample() walks a long vector's CDF in blocks of this many entries: a cumulative sum over all of a
# 262k-entry vocabulary would cost more than the rest of a sampled round's host work.
BLOCK = 1024


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a probability vector [V], or from weights in proportion to them (the uniform is
    scaled by their sum; inverse CDF, so one uniform per draw). Over a long
    vector in two levels: the block sums' CDF finds the block the draw falls in, then that block's
    own CDF the entry; never an entry of probability 0."""
    n = len(p)
    if n <= 4 * BLOCK:
        i = _inverse_cdf(p, rng.random() * p.sum(dtype=np.float64))
    else:
        whole = n - n % BLOCK
        ends = np.cumsum(p[:whole].reshape(-1, BLOCK).sum(axis=1, dtype=np.float64))  # [n // BLOCK]
        u = rng.random() * (ends[-1] + p[whole:].sum(dtype=np.float64))
        b = int(np.searchsorted(ends, u, side="right"))  # ends[b - 1] <= u < ends[b]: block b has mass
        block = _inverse_cdf(p[b * BLOCK : (b + 1) * BLOCK], u - (ends[b - 1] if b else 0.0))
        i = b * BLOCK + block if block >= 0 else -1
    # Sums taken in another order (or a uniform that rounds up) can put u past the last cumulative sum
    # by a rounding error: such a draw goes to the last entry with mass.
    return i if i >= 0 and p[i] > 0 else int(np.flatnonzero(p)[-1])


def _inverse_cdf(p: np.ndarray, u: float) -> int:
    """The entry whose CDF interval holds u, or -1 when u is not below p's sum."""
    i = int(np.searchsorted(np.cumsum(p, dtype=np.float64), u, side="right"))
    return i if i < len(p) else -1


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)); falls back to p where p <= q everywhere (only possible when p == q)."""
    r = np.maximum(p - q, 0.0)
    s = r.sum()
    return r / s if s > 0 else p
