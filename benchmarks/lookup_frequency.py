"""Prompt lookup's proposal: the continuation of the latest occurrence (edge-sd's) against a walk of
the most frequent successor of each n-gram (as SuffixDecoding proposes), on the same prompts and seeds.

    .venv/bin/python benchmarks/lookup_frequency.py PAIR_FOLDER [--modes greedy,chat]

Lookup alone with a static draft of 6, 64 new tokens, code and summarisation prompts 5-16. Writes
benchmarks/results/lookup_frequency.md: tokens per target forward and accepted / proposed.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from collections import defaultdict
from pathlib import Path
from unittest import mock

from edge_sd import GenerationConfig, Pipeline
from edge_sd.algorithms import lookup, menu
from edge_sd.bench.run import machine
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

SETTINGS = {"greedy": {}, "chat": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
            "t1": dict(temperature=1.0)}
OUT = Path(__file__).resolve().parent / "results" / "lookup_frequency.md"


class FrequentProposer(lookup.LookupProposer):
    """Each step proposes the successor seen most often after the longest matching n-gram (ties: the
    latest), then walks on from the proposal."""

    def __init__(self, history):
        super().__init__(history)
        # n-gram -> {successor: (times seen, latest position)}
        self.counts: dict[tuple[int, ...], dict[int, tuple[int, int]]] = defaultdict(dict)

    def _index(self) -> None:
        h = self.history
        for end in range(max(self._indexed, 1), len(h)):
            for n in range(lookup.NGRAM_MIN, lookup.NGRAM_MAX + 1):
                if end - n >= 0:
                    seen = self.counts[tuple(h[end - n : end])]
                    seen[h[end]] = (seen.get(h[end], (0, 0))[0] + 1, end)
        self._indexed = max(self._indexed, len(h))

    def follow(self, committed) -> None:
        super().follow(committed)
        if self._indexed == 0:  # the history was cut back: indexed anew
            self.counts.clear()

    def _continuation(self, k: int) -> list[int]:
        self._index()
        ctx, out = list(self.history), []
        while len(out) < k:
            for n in range(lookup.NGRAM_MAX, lookup.NGRAM_MIN - 1, -1):
                seen = self.counts.get(tuple(ctx[-n:])) if len(ctx) >= n else None
                if seen:
                    out.append(max(seen.items(), key=lambda kv: kv[1])[0])
                    ctx.append(out[-1])
                    break
            else:
                break
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pair")
    ap.add_argument("--modes", default="greedy,chat")
    args = ap.parse_args()
    prompts = [p.text for s in ("code", "summarisation") for p in prompt_sets.load(s, cache_dir(), 16)[4:]]
    pipe = Pipeline.from_folder(args.pair)
    rows = []
    for mode in args.modes.split(","):
        for name, proposer in (("latest occurrence", lookup.LookupProposer), ("most frequent", FrequentProposer)):
            # The algorithm menu builds lookup's proposer: it builds the variant's instead.
            with mock.patch.object(menu, "LookupProposer", proposer):
                stats = [pipe.generate(p, GenerationConfig(max_new_tokens=64, algorithm="lookup",
                                                           schedule="static", lookahead=6, seed=1000 + i,
                                                           **SETTINGS[mode])).stats
                         for i, p in enumerate(prompts)]
            acc, prop = sum(s.accepted for s in stats), sum(s.proposed for s in stats)
            tpf = [s.tokens_per_target_forward for s in stats]
            rows.append(f"| {mode} | {name} | {statistics.median(tpf):.2f} | {statistics.mean(tpf):.2f} "
                        f"| {acc}/{prop} = {acc / max(prop, 1):.3f} |")
            print(rows[-1], flush=True)
    OUT.write_text("# Prompt lookup: latest occurrence against most frequent successor\n\n"
                   f"{datetime.date.today()}; {machine()['cpu']}. "
                   f"{len(prompts)} prompts (code and summarisation 5-16), lookup alone, static draft of 6, "
                   "64 new tokens, seeds 1000+. Command: `python benchmarks/lookup_frequency.py PAIR`.\n\n"
                   "| decoding | proposal | tokens / target forward, median | mean | accepted / proposed |\n"
                   "|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
                   "Acceptance is what decides: a proposal that is accepted less often is not kept.\n")


if __name__ == "__main__":
    main()
