"""Prompt lookup's acceptance by the length of the n-gram it matched.

    .venv/bin/python benchmarks/lookup_match.py [--pair PAIR] [--modes greedy,sample,chat]

Lookup alone drafting one candidate a round, only in rounds whose longest match has n tokens (n = 4,
3, 2 in turn; the other rounds are plain steps), 64 new tokens, the first 12 code and summarisation
prompts, seeds 1000+. benchmarks/results/lookup_match.md also records, from commit c7c8cb5 (whose
version of this script ran it), auto keeping an acceptance estimate per match length against one
estimate for every match: no faster, so auto keeps one.

Writes benchmarks/results/lookup_match.{md,json,png}; `--report` writes the table and plot again.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

from edge_sd import GenerationConfig, Pipeline
from edge_sd.algorithms import lookup, menu
from edge_sd.bench.run import machine, write_results
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402  (the side-by-side benchmark's prompts, settings and rate)

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = (4, 3, 2)


class OnlyLength(lookup.LookupProposer):
    """Lookup that proposes only where its longest match has `length` tokens."""

    length = 0

    def _continuation(self, k: int) -> list[int]:
        found = super()._continuation(k)  # indexes the history: the match below reads the same table
        h = self.history
        longest = next((n for n in range(lookup.NGRAM_MAX, lookup.NGRAM_MIN - 1, -1)
                        if len(h) > n and tuple(h[-n:]) in self._next), 0)
        return found if longest == self.length else []


def acceptance(pair: Path, modes: list[str]) -> dict:
    pipe = Pipeline.from_folder(pair)
    prompts = [p.text for s in prompt_sets.SETS for p in prompt_sets.load(s, cache_dir(), 12)]
    out: dict = {}
    for mode in modes:
        for n in LENGTHS:
            with mock.patch.object(OnlyLength, "length", n), mock.patch.object(menu, "LookupProposer", OnlyLength):
                stats = [pipe.generate(p, GenerationConfig(max_new_tokens=64, algorithm="lookup", schedule="static",
                                                           lookahead=1, seed=1000 + i,
                                                           **dataclasses.asdict(llama_cpp.SAMPLING[mode]))).stats
                         for i, p in enumerate(prompts)]
            out.setdefault(mode, {})[str(n)] = [sum(s.accepted for s in stats), sum(s.proposed for s in stats)]
            print(f"{mode}, matches of {n}: {out[mode][str(n)]}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--modes", default="greedy,sample,chat")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        write_results(args.out, "lookup_match", report, plot)
        return
    modes = args.modes.split(",")
    if not set(modes) <= set(llama_cpp.SAMPLING):
        sys.exit(f"--modes takes {', '.join(llama_cpp.SAMPLING)}")
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "acceptance": acceptance(args.pair, modes)}
    previous = args.out / "lookup_match.json"
    if previous.is_file():  # the auto comparison of commit c7c8cb5 stays beside the new acceptance
        result["auto"] = json.loads(previous.read_text()).get("auto")
    print(write_results(args.out, "lookup_match", report, plot, result))


MODE_NAMES = {"greedy": "greedy", "sample": "T=1", "chat": "chat (T=0.8, top-k 40, top-p 0.95, min-p 0.05)"}


def report(result: dict) -> str:
    m, auto = result["machine"], result.get("auto")
    title = "# Prompt lookup: acceptance by match length" + (", and auto keeping an estimate for each" if auto else "")
    lines = [title, "",
             f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}; the pair "
             f"`{Path(result['pair']).name}`. Command: `.venv/bin/python benchmarks/lookup_match.py --pair PAIR`.", "",
             "Lookup alone, one candidate a round, drafting only where the longest match has n tokens (24 "
             "prompts: the first 12 code and summarisation prompts, 64 new tokens): accepted / proposed.", "",
             "| decoding | " + " | ".join(f"n = {n}" for n in LENGTHS) + " |", "|---|" + "---|" * len(LENGTHS)]
    for mode, by_n in result["acceptance"].items():
        lines.append(f"| {MODE_NAMES[mode]} | " + " | ".join(
            f"{a}/{p} = {a / max(p, 1):.2f}" for a, p in (by_n[str(n)] for n in LENGTHS)) + " |")
    if not auto:
        return "\n".join(lines) + "\n"
    lines += ["", f"Auto with an estimate per match length against one estimate for every match, at commit "
              f"c7c8cb5, one run each interleaved per prompt and mode, the order swapped every prompt "
              f"({auto['prompts']} prompts of benchmarks/llama_cpp.py, each with its seed, 64 new tokens): "
              "median decode rate (tok/s) and the median of the per-prompt ratios.", "",
              "| decoding | set | by length | one estimate | by length / one estimate |", "|---|---|---|---|---|"]
    for mode, runs in auto["runs"].items():
        for label in [*dict.fromkeys(auto["labels"]), None]:
            keep = [i for i, lab in enumerate(auto["labels"]) if label is None or lab == label]
            a = [runs["by length"][i] for i in keep]
            b = [runs["one estimate"][i] for i in keep]
            ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
            lines.append(f"| {MODE_NAMES[mode]} | {label or 'all'} | {statistics.median(a):.1f} | "
                         f"{statistics.median(b):.1f} | {ratio:.3f}x |")
    lines += ["", f"Greedy outputs equal between the two: {auto['greedy_equal']} of {auto['prompts']} prompts."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = (result.get("auto") or {}).get("runs")
    fig, axes = plt.subplots(1, 2 if runs else 1, figsize=(11 if runs else 5.5, 4), squeeze=False)
    left = axes[0][0]
    modes = list(result["acceptance"])
    width = 0.8 / len(LENGTHS)
    for j, n in enumerate(LENGTHS):
        rates = [a / max(p, 1) for a, p in (result["acceptance"][mode][str(n)] for mode in modes)]
        left.bar([i + j * width for i in range(len(modes))], rates, width, label=f"match of {n}")
    left.set_xticks([i + width for i in range(len(modes))], [MODE_NAMES[m].split(" (")[0] for m in modes])
    left.set_ylabel("lookup candidates accepted")
    left.set_ylim(0, 1)
    left.legend()
    if not runs:
        _finish(fig, result, path)
        return
    right = axes[0][1]
    for j, name in enumerate(("by length", "one estimate")):
        right.bar([i + j * 0.4 for i in range(len(runs))], [statistics.median(runs[m][name]) for m in runs], 0.4,
                  label=f"auto, {name}")
    right.set_xticks([i + 0.2 for i in range(len(runs))], [MODE_NAMES[m].split(" (")[0] for m in runs])
    right.set_ylabel("decode rate, tok/s (median)")
    right.legend()
    _finish(fig, result, path)


def _finish(fig, result: dict, path: Path) -> None:
    fig.suptitle(f"{Path(result['pair']).name}, {result['machine']['cores']} cores, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
