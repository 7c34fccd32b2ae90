"""Each verifier on synthetic distributions: the emitted token is distributed as the target's p.

Bound: for N draws over K categories, P(TV(empirical, p) > eps) <= 2^K exp(-2 N eps^2) (Weissman et
al. 2003, with L1 = 2 TV), so eps = sqrt((K ln 2 + ln(1/delta)) / (2N)) fails a correct verifier with
probability at most delta. Each test also shows that a wrong rule fails the same bound.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from edge_sd.algorithms import verify_exact, verify_greedy, verify_point, verify_standard
from edge_sd.sampling import SamplingConfig, residual, sample, warp
from edge_sd.vocab_maps import build_maps

N = 20000
DELTA = 1e-4
V = 6


def tv_bound(k: int, n: int = N, delta: float = DELTA) -> float:
    return math.sqrt((k * math.log(2) + math.log(1 / delta)) / (2 * n))


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def dists(seed: int, rows: int, v: int = V, alpha: float = 0.7) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet(np.full(v, alpha), size=rows)


def mapped_first_tokens(q_d: np.ndarray, mapping: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Counts of the first emitted token when a drafter token d ~ q_d is proposed as mapping[d] (-1: a
    proposal outside the target vocabulary) with the proposal q_d scattered into target ids (TLI's q',
    SLRS's psi), then verified by the standard rule."""
    proposal = np.zeros(V)
    ok = mapping >= 0
    np.add.at(proposal, mapping[ok], q_d[ok])

    def run(rng):
        c = int(mapping[sample(q_d, rng)])
        a, nxt = verify_standard([c], proposal[None], p, rng)
        return c if a == 1 else nxt

    return first_tokens(run)


def first_tokens(run) -> np.ndarray:
    counts = np.zeros(V)
    rng = np.random.default_rng(42)
    for _ in range(N):
        counts[run(rng)] += 1
    return counts


def test_standard_rule_emits_p() -> None:
    p, q = dists(1, 3), dists(2, 2)

    def run(rng):
        cands = [sample(q[0], rng), sample(q[1], rng)]
        a, nxt = verify_standard(cands, q, p, rng)
        return cands[0] if a >= 1 else nxt

    assert tv(first_tokens(run), p[0]) < tv_bound(V)

    def always_accept(rng):  # the test's power: proposing without verifying gives q, not p
        return sample(q[0], rng)

    assert tv(first_tokens(always_accept), p[0]) > tv_bound(V)


def test_standard_rule_bonus_token_when_all_accepted() -> None:
    p = dists(3, 3)
    q = p[:2].copy()  # a perfect drafter: everything is accepted, the bonus comes from p_3

    def run(rng):
        cands = [sample(q[0], rng), sample(q[1], rng)]
        a, nxt = verify_standard(cands, q, p, rng)
        assert a == 2
        return nxt

    assert tv(first_tokens(run), p[2]) < tv_bound(V)


def test_exact_match_rule_emits_p() -> None:
    p = dists(4, 2)

    def run(rng):
        a, nxt = verify_exact([2], None, p, rng)  # any candidate: the target's own draw decides
        return 2 if a == 1 else nxt

    assert tv(first_tokens(run), p[0]) < tv_bound(V)

    def trust_candidate(rng):
        return 2

    assert tv(first_tokens(trust_candidate), p[0]) > tv_bound(V)


def test_tli_restricted_proposal_emits_p() -> None:
    """q' = the drafter's q restricted to the intersection and renormalised, scattered into target ids;
    two drafter ids mapping to one target id add up."""
    q_d = dists(5, 1, v=8)[0]
    token_map = np.array([0, 1, 1, 2, -1, 3, 4, -1])  # drafter id -> target id (or not shared)
    p = dists(6, 2)
    q_restricted = q_d * (token_map >= 0)
    q_restricted /= q_restricted.sum()
    assert tv(mapped_first_tokens(q_restricted, token_map, p), p[0]) < tv_bound(V)


def test_slrs_prefix_proposal_emits_p() -> None:
    """psi(t) = sum of q(d) over drafter tokens whose longest target prefix is t; "none" never accepted."""
    target_bytes = [b"a", b"ab", b"b", b"c", b"abc", None]  # id 5: a special token
    drafter_bytes = [b"abd", b"a", b"bc", b"cab", b"abcd", b"x", b"ca"]
    by_bytes = {b: t for t, b in enumerate(target_bytes) if b}
    tv_ = SimpleNamespace(token_bytes=target_bytes, eos_ids=[], by_bytes=by_bytes, max_token_len=3)
    dv = SimpleNamespace(token_bytes=drafter_bytes, eos_ids=[], size=len(drafter_bytes))
    prefix = build_maps(dv, tv_).prefix
    assert prefix.tolist() == [1, 0, 2, 3, 4, -1, 3]
    q_d = dists(7, 1, v=len(drafter_bytes))[0]
    p = dists(8, 2)
    assert tv(mapped_first_tokens(q_d, prefix, p), p[0]) < tv_bound(V)

    # A leftover proposal is a point mass: accepted with probability p(t), else a draw of p without t.
    point = np.zeros((1, V))
    point[0, 3] = 1.0

    def leftover(rng):
        a, nxt = verify_standard([3], point, p, rng)
        return 3 if a == 1 else nxt

    assert tv(first_tokens(leftover), p[0]) < tv_bound(V)


def test_greedy_rule_agrees_with_general_rule_on_one_hot() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        logits = rng.normal(size=(4, V))
        cands = [int(x) for x in rng.integers(0, V, size=3)]
        if trial % 3 == 0:
            cands = [int(x) for x in np.argmax(logits[:3], axis=-1)]  # fully accepted drafts too
        p = warp(logits, SamplingConfig(0.0))
        q = np.zeros((3, V))
        q[np.arange(3), cands] = 1.0
        assert verify_greedy(cands, logits) == verify_standard(cands, q, p, rng)
        assert verify_greedy(cands, logits) == verify_exact(cands, None, p, rng)


def test_warp_top_k_top_p_and_residual() -> None:
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = warp(logits, SamplingConfig(1.0, top_k=3))
    np.testing.assert_allclose(p, [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0])
    p = warp(logits, SamplingConfig(1.0, top_p=0.7))
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    g = warp(np.array([1.0, 3.0, 3.0]), SamplingConfig(0.0))
    assert g.tolist() == [0.0, 1.0, 0.0]  # ties go to the lowest id
    np.testing.assert_allclose(residual(np.array([0.5, 0.5]), np.array([0.8, 0.2])), [0.0, 1.0])


def test_rows_warp_only_what_a_verifier_reads() -> None:
    """The loop hands verifiers Rows: each row, warped when first read, equals warp's row bit for bit
    (so seeded outputs do not depend on it), and a round rejected at its first proposal warps only
    the rows it read."""
    from edge_sd.algorithms.lookup import verify_point
    from edge_sd.sampling import Rows

    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(5, 50_000)) * 4).astype(np.float32)
    for cfg in (SamplingConfig(1.0), SamplingConfig(0.7, top_k=40), SamplingConfig(1.3, top_p=0.9)):
        full, rows = warp(logits, cfg), Rows(logits, cfg)
        for i in (3, 0, 4, 3):
            assert np.array_equal(rows[i], full[i])
            assert rows[i, 17] == full[i, 17]
    cfg = SamplingConfig(1.0)
    worst = [int(np.argmin(logits[i])) for i in range(4)]  # proposals of probability ~0: rejected
    for seed in range(5):
        rows = Rows(logits, cfg)
        got = verify_point(worst, None, rows, np.random.default_rng(seed))
        assert got == verify_point(worst, None, warp(logits, cfg), np.random.default_rng(seed))
        assert got[0] == 0 and sorted(rows._rows) == [0]


def test_sample_over_a_long_vector_follows_p() -> None:
    """sample() walks a long vector's CDF in blocks (sampling.BLOCK): its draws follow p, mass in the
    last partial block and zeros (whole blocks of them too) included, and never land on a zero."""
    from edge_sd.sampling import BLOCK

    n = 5 * BLOCK + 37
    p = np.zeros(n)
    hot = np.array([0, 5, BLOCK - 1, BLOCK, 3 * BLOCK + 7, n - 1])  # block edges, the partial tail
    p[hot] = np.random.default_rng(3).dirichlet(np.ones(len(hot)))
    rng = np.random.default_rng(11)
    draws = np.array([sample(p, rng) for _ in range(N)])
    assert np.isin(draws, hot).all()
    counts = np.array([(draws == h).sum() for h in hot], dtype=np.float64)
    assert tv(counts, p[hot]) < tv_bound(len(hot)) < tv(counts, np.roll(p[hot], 1))  # and not another p
    # u at the very end of the CDF (a uniform of nearly 1) still lands on an entry with mass
    top = SimpleNamespace(random=lambda: 1.0 - 1e-16)
    assert p[sample(p, top)] > 0 and p[sample(p[:BLOCK], top)] > 0
    # and u past the last sum (a uniform rounded up to 1), where the last blocks hold no mass and no
    # partial block follows, goes to the last entry with mass
    p2 = np.zeros(5 * BLOCK)
    p2[[3, 2 * BLOCK + 1]] = [0.25, 0.75]
    one = SimpleNamespace(random=lambda: 1.0)
    assert sample(p2, one) == 2 * BLOCK + 1 and sample(p2[: 2 * BLOCK + 2], one) == 2 * BLOCK + 1


def test_point_rule_emits_p() -> None:
    """Prompt lookup's deterministic candidates: accepted with p(c), else p without c; the first token
    is distributed as p whichever token is proposed, a likely one or an unlikely one."""
    p = dists(7, 3)
    for c in (int(np.argmax(p[0])), int(np.argmin(p[0]))):
        def run(rng, c=c):
            a, nxt = verify_point([c, 2], None, p, rng)
            return c if a >= 1 else nxt

        assert tv(first_tokens(run), p[0]) < tv_bound(V)

    def always_accept(rng):  # the test's power: an unverified proposal is a point mass
        return int(np.argmin(p[0]))

    assert tv(first_tokens(always_accept), p[0]) > tv_bound(V)


def test_point_rule_second_position_and_bonus() -> None:
    """Given the first candidate accepted, the second emitted token is distributed as p_2."""
    p = dists(8, 3)
    counts = np.zeros(V)
    rng = np.random.default_rng(3)
    while counts.sum() < N:
        a, nxt = verify_point([1, 4], None, p, rng)
        if a >= 1:
            counts[4 if a == 2 else nxt] += 1
    assert tv(counts, p[1]) < tv_bound(V)


def test_a_plain_sampled_step_draws_from_the_warped_distribution() -> None:
    """sampling.draw, which plain sampled steps use instead of normalising a row first: its draws
    follow warp's probabilities (temperature and top-k), never land outside the top k, and top-p goes
    through warp itself (the same draw as sample(warp(...)) from the same generator)."""
    from edge_sd.sampling import BLOCK, draw

    rng = np.random.default_rng(8)
    logits = (rng.normal(size=5 * BLOCK + 11) * 2).astype(np.float32)
    hot = rng.choice(len(logits), size=6, replace=False)
    logits[hot] += 12.0  # six likely ids spread over the blocks, the rest a thin tail
    cfg = SamplingConfig(0.8, top_k=6)
    p = warp(logits, cfg)
    draws = np.array([draw(logits, cfg, rng) for _ in range(N)])
    assert np.isin(draws, np.flatnonzero(p)).all() and len(np.flatnonzero(p)) == 6
    counts = np.array([(draws == h).sum() for h in hot], dtype=np.float64)
    assert tv(counts, p[hot]) < tv_bound(len(hot)) < tv(counts, np.roll(p[hot], 1))
    nucleus = SamplingConfig(1.0, top_p=0.9)
    for seed in range(5):
        assert draw(logits, nucleus, np.random.default_rng(seed)) == sample(warp(logits, nucleus),
                                                                             np.random.default_rng(seed))
