"""SLRS, string-level rejection sampling with the one-token decision horizon.

A fresh proposal samples d ~ q and proposes g(d), the longest target token that is a prefix of bytes(d); its
distribution psi = q scattered through g is known exactly. When g(d) covers only part of bytes(d), the next
proposal is the longest target prefix of the leftover bytes, a point mass given d. Both are verified with the
speculative sampling rule (docs/algorithms.md, "The verification rules"), which is why the proposer only has
to state psi.
"""

from __future__ import annotations

import numpy as np

from edge_sd.algorithms.base import Draft, DrafterState, StopRule, scatter_to_targets
from edge_sd.algorithms.standard import verify_standard
from edge_sd.sampling import SamplingConfig, sample, warp
from edge_sd.vocab import Vocab
from edge_sd.vocab_maps import longest_prefix_token


class SLRSProposer:
    name = "slrs"
    verifier = staticmethod(verify_standard)  # leftovers are point masses: psi rows like any proposal

    def __init__(self, drafter: DrafterState, target_vocab: Vocab, prefix_map: np.ndarray,
                 target_width: int, cfg: SamplingConfig, rng: np.random.Generator):
        self.drafter = drafter
        self.prefix = prefix_map  # [V_d] g(d), or -1 when no target token is a prefix of bytes(d)
        self.target_width = target_width
        self.cfg = cfg
        self.rng = rng
        self.eos = set(target_vocab.eos_ids)
        self.tb = target_vocab.token_bytes
        self.by_bytes = target_vocab.by_bytes
        self.max_len = target_vocab.max_token_len

    def propose(self, k: int, committed: list[int], stop: StopRule | None = None) -> Draft:
        # Leftovers cost no drafter token and come between drafter tokens: the stop rule is asked here,
        # right after each drafter token, as the other proposers' loop asks it.
        drafting = self.drafter.drafting(k, stop, ask=False)
        cands: list[int] = []
        rows: list[np.ndarray] = []
        leftover = b""
        more = True  # the stop rule's answer after the last drafted token
        while len(cands) < k:
            if leftover:
                row = np.zeros(self.target_width)
                t = longest_prefix_token(self.by_bytes, leftover, self.max_len)
                if t >= 0:
                    row[t] = 1.0
                    leftover = leftover[len(self.tb[t] or b""):]
            else:
                logits = next(drafting, None) if more else None  # [V_d]
                if logits is None:
                    break
                q = warp(logits, self.cfg, self.cfg.window(self.drafter.ids))
                d = int(np.argmax(q)) if self.cfg.greedy else sample(q, self.rng)
                row = scatter_to_targets(q, self.prefix, self.target_width)  # psi(t) = sum of q(d), g(d) = t
                t = int(self.prefix[d])
                self.drafter.push(d)
                more = self.drafter.keep_drafting(logits)
                if t >= 0:
                    leftover = (self.drafter.vocab.token_bytes[d] or b"")[len(self.tb[t] or b""):]
            cands.append(t)
            rows.append(row)
            if t < 0 or t in self.eos:
                break  # "none" is never accepted, and nothing follows EOS
        return self.drafter.draft(cands, rows)
