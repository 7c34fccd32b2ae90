"""Standard speculative sampling, and the drafting shared with TLI (token-level maps)."""

from __future__ import annotations

import numpy as np

from edge_sd.algorithms.base import Draft, DrafterState, StopRule, scatter_to_targets
from edge_sd.sampling import Probs, Rows, SamplingConfig, sample, warp


def verify_standard(
    candidates: list[int], q: np.ndarray | None, p: Probs, rng: np.random.Generator
) -> tuple[int, int]:
    """Accept c_i with probability min(1, p_i(c_i) / q_i(c_i)); at the first rejection emit a sample of
    norm(max(0, p_i - q_i)); if all pass, a sample of p_{m+1}.

    candidates: m target ids (-1: a proposal outside the target vocabulary, always rejected)
    q: [m, V] proposal distributions; p: [m+1, V] target distributions. Returns (accepted, next token).
    """
    rows = Rows.of(p)
    for i, c in enumerate(candidates):
        assert q is not None
        if c >= 0 and q[i, c] > 0.0:
            ratio = rows.dist(i).prob(c) / q[i, c]
            if ratio >= 1.0 or rng.random() < ratio:
                continue
        return i, rows.dist(i).sample_residual(q[i], rng)
    m = len(candidates)
    return m, rows.dist(m).sample(rng)


def verify_greedy(candidates: list[int], logits: np.ndarray) -> tuple[int, int]:
    """Greedy decoding, where every algorithm's rule reduces to: accept while c_i == argmax p_i.

    logits: [m+1, V]. Ties go to the lowest id (np.argmax), as in plain greedy decoding.
    """
    top = np.argmax(logits, axis=-1)
    for i, c in enumerate(candidates):
        if c != top[i]:
            return i, int(top[i])
    return len(candidates), int(top[len(candidates)])


class MappedProposer:
    """Drafts drafter tokens that have a target twin and proposes the twins (TLI; standard when the
    map is the identity). q' is the drafter's warped distribution restricted to mapped ids."""

    name = "standard"
    verifier = staticmethod(verify_standard)

    def __init__(self, drafter: DrafterState, token_map: np.ndarray, target_width: int,
                 cfg: SamplingConfig, rng: np.random.Generator, eos_ids: list[int]):
        self.drafter = drafter
        self.map = token_map  # [V_d] target id or -1
        self.mapped = token_map >= 0
        self.target_width = target_width
        self.cfg = cfg
        self.rng = rng
        self.eos = set(eos_ids)

    def propose(self, k: int, committed: list[int], stop: StopRule | None = None) -> Draft:
        cands: list[int] = []
        rows: list[np.ndarray] = []
        for logits in self.drafter.drafting(k, stop):  # [V_d]
            width = min(len(logits), len(self.map))
            if self.cfg.greedy:
                masked = np.where(self.mapped[:width], logits[:width], -np.inf)
                d = int(np.argmax(masked))
                if not np.isfinite(masked[d]):
                    break
                qd = np.zeros(width)
                qd[d] = 1.0
            else:
                # the drafter's own penalties count its own ids (the drafted ones included)
                qd = warp(logits[:width], self.cfg, self.cfg.window(self.drafter.ids)) * self.mapped[:width]
                mass = qd.sum()
                if mass <= 0.0:  # top-k/top-p left nothing in the intersection: stop drafting
                    break
                qd /= mass
                d = sample(qd, self.rng)
            t = int(self.map[d])
            cands.append(t)
            rows.append(scatter_to_targets(qd, self.map, self.target_width))
            self.drafter.push(d)
            if t in self.eos:
                break
        return self.drafter.draft(cands, rows)



class TLIProposer(MappedProposer):
    name = "tli"
