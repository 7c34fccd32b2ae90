"""The maps that bridge two vocabularies: TLI's intersection (drafter ids with a byte-identical target
twin) and SLRS's prefix map (each drafter id's longest target prefix), built at export and kept in the
pair folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_sd.vocab import Vocab


def same_vocabulary(a: Vocab, b: Vocab) -> bool:
    """Whether two tokenizers are the same vocabulary: same byte string for every id.

    Logits widths are not compared: models often pad their embedding matrix (151936 vs 152064).
    """
    return a.size == b.size and a.token_bytes == b.token_bytes and a.special_ids == b.special_ids


@dataclass
class VocabMaps:
    """Precomputed maps between a drafter vocabulary D and a target vocabulary T.

    intersection: int64 [|D|], the target id with the same bytes as each drafter id, or -1 (TLI).
    prefix: int64 [|D|], the longest target token whose bytes are a prefix of the drafter token's
        bytes, or -1 when none is (SLRS's g).
    """

    intersection: np.ndarray
    prefix: np.ndarray

    def save(self, path: Path) -> None:
        np.savez_compressed(path, intersection=self.intersection, prefix=self.prefix)

    @classmethod
    def load(cls, path: Path) -> VocabMaps:
        with np.load(path) as z:
            return cls(z["intersection"].astype(np.int64), z["prefix"].astype(np.int64))


def build_maps(drafter: Vocab, target: Vocab) -> VocabMaps:
    """Build the TLI intersection and the SLRS prefix map, EOS mapped to EOS explicitly."""
    by_bytes = target.by_bytes
    max_len = target.max_token_len
    inter = np.full(drafter.size, -1, dtype=np.int64)
    prefix = np.full(drafter.size, -1, dtype=np.int64)
    for d, b in enumerate(drafter.token_bytes):
        if not b:
            continue
        inter[d] = by_bytes.get(b, -1)
        prefix[d] = longest_prefix_token(by_bytes, b, max_len)
    if drafter.eos_ids and target.eos_ids:
        for d in drafter.eos_ids:
            inter[d] = target.eos_ids[0]
            prefix[d] = target.eos_ids[0]
    return VocabMaps(inter, prefix)


def longest_prefix_token(target_by_bytes: dict[bytes, int], data: bytes, max_len: int) -> int:
    """The longest target token whose bytes are a prefix of `data`, or -1."""
    for n in range(min(len(data), max_len), 0, -1):
        t = target_by_bytes.get(data[:n])
        if t is not None:
            return t
    return -1
