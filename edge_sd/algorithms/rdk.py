"""RDK, redistributing drafter kernels, in its first-order (linear-time) form.

The drafter's distribution q, restricted to the drafter tokens that have a row in the kernel M (kept tokens
with a target twin) and renormalised, is pushed through M: psi = q^T M, a sparse product over the kernel's
non-zeros. A candidate is a draw from psi (greedy: its argmax), verified with the speculative sampling rule
against psi, so RDK is lossless whatever M is. M (built at export, `edge_sd.export.prune`) keeps each row's
mass on the twin and moves some to target tokens that a pruned drafter can no longer propose, which is how a
pruned drafter recovers acceptance.

After a candidate the drafter continues from its bytes: the drafter token with the same bytes (the
pruned drafter still embeds every token; only its LM head lost rows), else the drafter's own
tokenization of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sd.algorithms.base import Draft, DrafterState, StopRule
from edge_sd.algorithms.standard import verify_standard
from edge_sd.errors import ArtifactError
from edge_sd.sampling import SamplingConfig, sample, warp
from edge_sd.vocab import Vocab

# Greedy decoding drafts argmax psi with q at temperature 1 (the drafter's own distribution): a
# one-hot q would send all of psi through one row and never reach the tokens the kernel restores.
GREEDY_DRAFT = SamplingConfig(temperature=1.0)


@dataclass(frozen=True)
class Kernel:
    """M in coordinate form: M[rows[i], cols[i]] = vals[i]; rows are drafter ids, cols target ids."""

    rows: np.ndarray
    cols: np.ndarray
    vals: np.ndarray

    @classmethod
    def of(cls, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> Kernel:
        """From coordinate arrays of any integer and float types (the file stores int32 ids)."""
        return cls(np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64),
                   np.asarray(vals, dtype=np.float64))

    @classmethod
    def load(cls, path: Path) -> Kernel:
        try:
            with np.load(path) as z:
                kernel = cls.of(z["rows"], z["cols"], z["vals"])
        except (OSError, KeyError, ValueError) as e:
            raise ArtifactError(f"{path}: not a readable RDK kernel ({e})") from None
        if not (len(kernel.rows) == len(kernel.cols) == len(kernel.vals)) or (kernel.vals < 0).any():
            raise ArtifactError(f"{path}: the kernel's arrays disagree in length or hold negative weights")
        return kernel

    def has_row(self, size: int) -> np.ndarray:
        """[size] bool: drafter ids with a row."""
        mask = np.zeros(size, dtype=bool)
        mask[self.rows[self.rows < size]] = True
        return mask

    def push(self, q: np.ndarray, width: int) -> np.ndarray:
        """psi = q^T M over the first `width` target ids. q: [V_d], zero outside rows -> [width]."""
        w = q[self.rows] * self.vals
        inside = self.cols < width
        return np.bincount(self.cols[inside], weights=w[inside], minlength=width)


def twins_of_targets(intersection: np.ndarray, target_size: int) -> np.ndarray:
    """[target_size] the lowest drafter id with each target token's bytes, or -1."""
    twin = np.full(target_size, -1, dtype=np.int64)
    d = np.nonzero((intersection >= 0) & (intersection < target_size))[0][::-1]
    twin[intersection[d]] = d
    return twin


class RDKProposer:
    name = "rdk"
    verifier = staticmethod(verify_standard)

    def __init__(self, drafter: DrafterState, kernel: Kernel, intersection: np.ndarray, target_vocab: Vocab,
                 target_width: int, cfg: SamplingConfig, rng: np.random.Generator):
        self.drafter = drafter
        self.kernel = kernel
        self.rowed = kernel.has_row(drafter.vocab.size)
        self.twin = twins_of_targets(intersection, target_width)
        self.target_bytes = target_vocab.token_bytes
        self.width = target_width
        self.cfg = cfg
        self.rng = rng
        self.eos = set(target_vocab.eos_ids)

    def propose(self, k: int, committed: list[int], stop: StopRule | None = None) -> Draft:
        cands: list[int] = []
        rows: list[np.ndarray] = []
        for logits in self.drafter.drafting(k, stop):  # [V_d]; -inf on rows a pruned head lost
            cfg = GREEDY_DRAFT if self.cfg.greedy else self.cfg
            q = warp(logits, cfg, cfg.window(self.drafter.ids)) * self.rowed[: len(logits)]
            mass = q.sum()
            if mass <= 0.0:  # top-k/top-p left nothing with a kernel row: stop drafting
                break
            psi = self.kernel.push(q / mass, self.width)  # [V_t]
            if self.cfg.greedy:
                t = int(np.argmax(psi))
                psi = np.zeros(self.width)
                psi[t] = 1.0  # the proposal is this point mass
            else:
                t = sample(psi, self.rng)
            cands.append(t)
            rows.append(psi)
            if t in self.eos or not self._continue_from(t):
                break
        return self.drafter.draft(cands, rows)

    def _continue_from(self, t: int) -> bool:
        """Feed the drafter the candidate's bytes; False when it cannot spell them."""
        d = int(self.twin[t])
        ids = [d] if d >= 0 else self.drafter.vocab.encode_bytes(self.target_bytes[t] or b"")
        if not ids:
            return False
        for d in ids:
            self.drafter.push(d)
        return True
