"""Warping and sampling (probabilities in float64). Naming: `p` is the target's distribution, `q` the drafter's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingConfig:
    """The user's sampling settings. temperature 0 means greedy (ties go to the lowest id)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def warp(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Probabilities after temperature, top-k and top-p. logits: [..., V] -> float64 [..., V].

    Greedy gives a one-hot at the argmax, so that every verifier's general rule reduces to exact match.
    """
    if cfg.greedy:
        out = np.zeros(np.shape(logits), dtype=np.float64)
        np.put_along_axis(out, np.argmax(logits, axis=-1)[..., None], 1.0, axis=-1)
        return out
    # float64 probabilities normalised by a float64 sum of float32 weights: a third of the time of
    # float64 throughout over a 262k-entry row. The probabilities move by about 1e-6 of themselves;
    # plain and speculative decoding share this function.
    p = _weights(logits, cfg).astype(np.float64)
    p /= p.sum(axis=-1, keepdims=True)
    if cfg.top_p < 1.0:
        p = _top_p(p, cfg.top_p)
    return p


def _weights(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """exp(logits / T - max) after top-k, unnormalised: one float32 copy worked on in place, exp in
    float32 (the logits' own precision; numpy vectorises it). [..., V] -> float32 [..., V]."""
    x = np.array(logits, dtype=np.float32)
    if cfg.temperature != 1.0:
        x /= np.float32(cfg.temperature)
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = np.partition(x, -cfg.top_k, axis=-1)[..., -cfg.top_k, None]
        x[x < kth] = -np.inf
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    return x


class Rows:
    """The warped distributions of logits [n, V], each row warped when a verifier first reads it
    (`p[i]`, `p[i, c]`). A round that rejects its first proposal reads one or two rows of n, and
    warping a 262k-entry row costs more than the rest of the round's host work. A row is exactly
    what `warp` gives it among the others."""

    def __init__(self, logits: np.ndarray, cfg: SamplingConfig):
        self.logits, self.cfg = logits, cfg
        self._rows: dict[int, np.ndarray] = {}

    def __getitem__(self, key: int | tuple[int, int]) -> np.ndarray:
        i, c = key if isinstance(key, tuple) else (key, None)
        if i not in self._rows:
            self._rows[i] = warp(self.logits[i], self.cfg)
        return self._rows[i] if c is None else self._rows[i][c]


# What verifiers read p from: an array [m+1, V] of warped rows, or Rows warping them on demand.
Probs = np.ndarray | Rows


def draw(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
    """One draw from warp(logits, cfg) for one position [V] (sampled, not greedy), without
    normalising: `sample` scales its uniform by the weights' sum, so a plain sampled step skips
    warp's float64 copy and division of a 262k-entry row. Top-p needs the normalised, sorted
    probabilities and goes through warp."""
    return sample(warp(logits, cfg) if cfg.top_p < 1.0 else _weights(logits, cfg), rng)


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one).
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, axis=-1)
    before = np.cumsum(sorted_p, axis=-1) - sorted_p
    keep_sorted = before < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, axis=-1)
    out = np.where(keep, p, 0.0)
    return out / out.sum(axis=-1, keepdims=True)


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
