"""The sampler chain against a straightforward reference that sorts the whole row in float64: the same
support and the same probabilities on random and peaked logits, each filter's boundary, the
penalties' rule and window, and negative controls (another order, an off-by-one) that the same
comparison catches."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edge_sd.sampling import Rows, SamplingConfig, chain, draw, penalize, warp

ORDER = ("penalties", "temperature", "top_k", "top_p", "min_p")


def reference(logits: np.ndarray, cfg: SamplingConfig, window=(), order=ORDER, inclusive_top_p: bool = False,
              exact_top_k: bool = False) -> np.ndarray:
    """The chain written out plainly: every filter over the whole row, sorted in full. order,
    inclusive_top_p and exact_top_k make the wrong variants of the negative controls."""
    x = np.asarray(logits, dtype=np.float64).copy()
    p = None  # probabilities once temperature has been applied

    def probs() -> np.ndarray:
        nonlocal p
        if p is None:
            e = np.exp(x - x.max())
            p = e / e.sum()
        return p

    for step in order:
        if step == "penalties" and cfg.penalized and len(window):
            ids, counts = np.unique(np.asarray(window), return_counts=True)
            for t, n in zip(ids, counts, strict=True):
                v = x[t]
                if cfg.repetition_penalty != 1.0:
                    v = v / cfg.repetition_penalty if v > 0 else v * cfg.repetition_penalty
                x[t] = v - (n * cfg.frequency_penalty + cfg.presence_penalty)
        elif step == "temperature":
            x = x / cfg.temperature
            p = None
        elif step == "top_k" and 0 < cfg.top_k < len(x):
            q = probs()
            ranked = np.argsort(-q, kind="stable")
            keep = ranked[: cfg.top_k] if exact_top_k else np.flatnonzero(q >= q[ranked[cfg.top_k - 1]])
            p = np.zeros_like(q)
            p[keep] = q[keep] / q[keep].sum()
        elif step == "top_p" and cfg.top_p < 1.0:
            q = probs()
            ranked = np.argsort(-q, kind="stable")
            before = np.cumsum(q[ranked]) - q[ranked]
            keep = ranked[before <= cfg.top_p if inclusive_top_p else before < cfg.top_p]
            p = np.zeros_like(q)
            p[keep] = q[keep] / q[keep].sum()
        elif step == "min_p" and cfg.min_p > 0.0:
            q = probs()
            p = np.where(q >= cfg.min_p * q.max(), q, 0.0)
            p /= p.sum()
    return probs()


def cases() -> list[tuple[np.ndarray, SamplingConfig, list[int]]]:
    """Rows of three shapes (flat noise, peaked like a language model, a handful of near-ties), with
    every filter alone and chained, with and without penalties."""
    rng = np.random.default_rng(0)
    rows = []
    for v in (50, 3000, 262_144):
        flat = rng.normal(size=v).astype(np.float32)
        peaked = (rng.normal(size=v) * 2).astype(np.float32)
        peaked[rng.choice(v, 30, replace=False)] += rng.uniform(4, 12, size=30).astype(np.float32)
        rows += [flat, peaked]
    configs = [
        SamplingConfig(1.0, top_k=40), SamplingConfig(0.8, top_p=0.95), SamplingConfig(0.7, min_p=0.05),
        SamplingConfig(0.8, top_k=40, top_p=0.95, min_p=0.05), SamplingConfig(1.3, top_k=7, top_p=0.5),
        SamplingConfig(0.8, top_p=0.6, min_p=0.2), SamplingConfig(1.0, top_k=300),
        SamplingConfig(0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.7,
                       frequency_penalty=0.4),
        SamplingConfig(1.0, top_p=0.9, repetition_penalty=0.8, repeat_last_n=-1),
        SamplingConfig(1.2, frequency_penalty=-1.0),
    ]
    # logits on a coarse grid tie often, at the k-th value too (as half-precision logits do)
    rows.append(np.round(rows[-1] * 2) / 2)
    out = []
    for row, cfg in itertools.product(rows, configs):
        top = list(np.argsort(-row)[:8])  # penalize likely tokens, repeated, so that it matters
        out.append((row, cfg, top + top[:3] + [int(rng.integers(len(row)))]))
    # each filter exactly at its boundary: four equal tokens and top-p 0.5; a tie at the k-th value
    out.append((np.zeros(4, np.float32), SamplingConfig(1.0, top_p=0.5), []))
    out.append((np.array([3, 2, 2, 1, 0], np.float32), SamplingConfig(1.0, top_k=2), []))
    return out


def mismatches(make) -> int:
    """How many cases a distribution-maker (logits, cfg, window) -> p gets wrong against the reference:
    another support, or probabilities apart by more than float32 rounding."""
    wrong = 0
    for row, cfg, window in cases():
        want = reference(row, cfg, window)
        got = make(row, cfg, window)
        if not np.array_equal(np.flatnonzero(got), np.flatnonzero(want)) or not np.allclose(got, want, rtol=1e-5,
                                                                                               atol=1e-9):
            wrong += 1
    return wrong


def test_chain_equals_the_reference() -> None:
    assert mismatches(warp) == 0


@pytest.mark.parametrize("variant", [
    dict(order=("penalties", "top_k", "top_p", "min_p", "temperature")),  # llama.cpp's default: temperature last
    dict(order=("penalties", "temperature", "top_p", "top_k", "min_p")),  # top-p before top-k
    dict(order=("temperature", "penalties", "top_k", "top_p", "min_p")),  # penalties after temperature
    dict(inclusive_top_p=True),  # one token more at top-p's boundary
    dict(exact_top_k=True),  # ties at the k-th value cut
])
def test_the_comparison_catches_a_wrong_chain(variant: dict) -> None:
    """Negative controls: the same comparison fails a chain applied in another order or off by one."""
    assert mismatches(lambda row, cfg, window: reference(row, cfg, window, **variant)) > 0


def support(p: np.ndarray) -> list[int]:
    return np.flatnonzero(p).tolist()


def test_filter_boundaries() -> None:
    # top-k keeps every tie at the k-th value (as Hugging Face does)
    assert support(warp(np.array([3, 2, 2, 1, 0], np.float32), SamplingConfig(1.0, top_k=2))) == [0, 1, 2]
    # top-p: the mass before a token must be below top_p; four equal tokens, top_p 0.5 exactly -> two
    flat = np.zeros(4, np.float32)
    assert support(warp(flat, SamplingConfig(1.0, top_p=0.5))) == [0, 1]
    assert support(reference(flat, SamplingConfig(1.0, top_p=0.5), inclusive_top_p=True)) == [0, 1, 2]
    assert support(warp(flat, SamplingConfig(1.0, top_p=0.5000001))) == [0, 1, 2]
    # ...and the ties it keeps go by id
    assert support(warp(np.array([0, 1, 1, 1], np.float32), SamplingConfig(1.0, top_p=0.4))) == [1, 2]
    # min-p at 1 keeps exactly the tokens tied with the top one
    assert support(warp(np.array([1, 0, 1, 0.999], np.float32), SamplingConfig(0.5, min_p=1.0))) == [0, 2]
    # top-p always keeps the most likely token, however small top_p
    assert support(warp(np.array([0, 5, 1], np.float32), SamplingConfig(1.0, top_p=1e-9))) == [1]
    # a pruned drafter's -inf rows never survive, whatever the filter
    pruned = np.array([-np.inf, 2, -np.inf, 1, 0], np.float32)
    for cfg in (SamplingConfig(1.0, top_k=4), SamplingConfig(1.0, top_p=0.999), SamplingConfig(1.0, min_p=1e-6)):
        assert 0 not in support(warp(pruned, cfg)) and 2 not in support(warp(pruned, cfg))


def test_penalties_follow_llama_cpp_rule_and_window() -> None:
    x = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    cfg = SamplingConfig(1.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # token 0 twice: 2 / 2 - (2 * 0.25 + 0.5); token 1 once: -2 * 2 - (0.25 + 0.5); the rest as they were
    np.testing.assert_array_equal(penalize(x, cfg, [0, 1, 0]), [0.0, -4.75, 1.0, 0.5])
    assert penalize(x, cfg, []) is not None and np.array_equal(penalize(x, cfg, []), x)
    history = [3, 0, 1]
    assert list(SamplingConfig(1.0, repetition_penalty=1.1, repeat_last_n=2).window(history)) == [0, 1]
    assert list(SamplingConfig(1.0, repetition_penalty=1.1, repeat_last_n=-1).window(history)) == history
    assert list(SamplingConfig(1.0, repetition_penalty=1.1, repeat_last_n=0).window(history)) == []
    assert list(SamplingConfig(1.0).window(history)) == []  # no penalty set: nothing to count
    # greedy decoding takes the argmax after the penalties
    assert support(warp(x, SamplingConfig(0.0, repetition_penalty=4.0), [0])) == [2]


def test_rows_count_the_candidates_before_each_position() -> None:
    """A verifier's row i is what plain decoding would sample from after committing the candidates
    before it: its penalties count them."""
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(4, 500)) * 3).astype(np.float32)
    cfg = SamplingConfig(0.9, top_k=20, repetition_penalty=1.5, presence_penalty=1.0, repeat_last_n=4)
    history, cands = [5, 6, 7, 8, 9], [11, 12, 13]
    rows = Rows(logits, cfg, cfg.window(history), cands)
    for i in range(4):
        want = warp(logits[i], cfg, (history + cands[:i])[-4:])
        assert np.array_equal(rows[i], want)
        assert rows[i, cands[min(i, 2)]] == want[cands[min(i, 2)]]
    np.testing.assert_array_equal(rows.penalized()[2], penalize(logits[2], cfg, [8, 9, 11, 12]))


def test_sparse_rows_sample_their_distribution() -> None:
    """A filtered row keeps only its survivors: its draws, its draws without a token and its residuals
    follow the dense row's probabilities."""
    rng = np.random.default_rng(4)
    x = (rng.normal(size=5000) * 3).astype(np.float32)
    cfg = SamplingConfig(0.8, top_k=6)
    d, p = chain(x, cfg), warp(x, cfg)
    assert d.ids is not None and len(d.ids) == 6
    n = 20_000
    hot = np.flatnonzero(p)

    def freq(draws: list[int]) -> np.ndarray:
        return np.array([draws.count(h) for h in hot]) / n

    bound = 0.03  # TV over 6 categories and 20k draws: far above the sampling noise, far below an error
    assert 0.5 * np.abs(freq([draw(x, cfg, rng) for _ in range(n)]) - p[hot]).sum() < bound
    top = int(hot[np.argmax(p[hot])])
    without = p.copy()
    without[top] = 0
    without /= without.sum()
    assert 0.5 * np.abs(freq([d.sample_without(top, rng) for _ in range(n)]) - without[hot]).sum() < bound
    q = np.zeros(5000)
    q[hot[:3]] = 1 / 3
    r = np.maximum(p - q, 0)
    r /= r.sum()
    assert 0.5 * np.abs(freq([d.sample_residual(q, rng) for _ in range(n)]) - r[hot]).sum() < bound
    assert d.prob(top) == p[top] and d.prob(int(np.argmin(x))) == 0.0
