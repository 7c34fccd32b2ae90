"""Prompt lookup's acceptance by the length of the n-gram it matched.

    .venv/bin/python benchmarks/lookup_match.py [--pair PAIR] [--modes greedy,sample,chat]

Lookup alone drafting one candidate a round, only in rounds whose longest match has n tokens (n = 4,
3, 2, 1 in turn; the other rounds are plain steps; lookup itself matches 2 tokens at least), 64 new
tokens, the first 12 code and summarisation prompts, seeds 1000+. Then auto as it is against auto
whose lookup also matches single tokens, interleaved per prompt and mode, on the 18 prompts of
benchmarks/llama_cpp.py (`--auto-single 0` skips it). benchmarks/results/lookup_match.md also
records, from commit c7c8cb5 (whose version of this script ran it), auto keeping an acceptance
estimate per match length against one estimate for every match: no faster, so auto keeps one.

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
LENGTHS = (4, 3, 2, 1)


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
            with mock.patch.object(OnlyLength, "length", n), mock.patch.object(menu, "LookupProposer", OnlyLength), \
                    mock.patch.object(lookup, "NGRAM_MIN", 1):
                stats = [pipe.generate(p, GenerationConfig(max_new_tokens=64, algorithm="lookup", schedule="static",
                                                           lookahead=1, seed=1000 + i,
                                                           **dataclasses.asdict(llama_cpp.SAMPLING[mode]))).stats
                         for i, p in enumerate(prompts)]
            out.setdefault(mode, {})[str(n)] = [sum(s.accepted for s in stats), sum(s.proposed for s in stats)]
            print(f"{mode}, matches of {n}: {out[mode][str(n)]}", file=sys.stderr, flush=True)
    return out


def single_tokens(pair: Path, modes: list[str], per_set: int) -> dict:
    """Decode rates of auto as it is and of auto whose lookup also matches single tokens (a pipeline
    each: auto's estimates stay apart), interleaved per prompt and mode, the order swapped each run."""
    pipes = {"as it is": Pipeline.from_folder(pair), "single tokens too": Pipeline.from_folder(pair)}
    prompts = llama_cpp.prompt_list(list(llama_cpp.SHORT_SETS), per_set, llama_cpp.SKIP)

    def rate(name: str, text: str, mode: str, seed: int) -> dict:
        with mock.patch.object(lookup, "NGRAM_MIN", 1 if name == "single tokens too" else lookup.NGRAM_MIN):
            return llama_cpp._edge(pipes[name], text, 64, "auto", mode, seed)

    for name in pipes:  # warm-up: auto's load-time calibration, the first forwards of each shape
        rate(name, prompts[0][1], "greedy", 1)
    runs: dict = {mode: {name: [] for name in pipes} for mode in modes}
    equal, turn = 0, 0
    for i, (_, text) in enumerate(prompts):
        for mode in modes:
            order = list(pipes)[:: 1 if turn % 2 else -1]
            turn += 1
            got = {name: rate(name, text, mode, 1000 + i) for name in order}
            for name, r in got.items():
                runs[mode][name].append(r["rate"])
            equal += mode == "greedy" and got["as it is"]["ids"] == got["single tokens too"]["ids"]
    return {"labels": [label for label, _ in prompts], "runs": runs, "greedy_equal": equal, "prompts": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--modes", default="greedy,sample,chat")
    ap.add_argument("--auto-single", type=int, default=6, metavar="PER_SET",
                    help="prompts of each set for auto with and without single-token matches (0: skip)")
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
    if args.auto_single:
        result["single"] = single_tokens(args.pair, modes, args.auto_single)
    previous = args.out / "lookup_match.json"
    if previous.is_file():  # the auto comparison of commit c7c8cb5 stays beside the new acceptance
        result["auto"] = json.loads(previous.read_text()).get("auto")
    print(write_results(args.out, "lookup_match", report, plot, result))


MODE_NAMES = {"greedy": "greedy", "sample": "T=1", "chat": "chat (T=0.8, top-k 40, top-p 0.95, min-p 0.05)"}


def report(result: dict) -> str:
    m, auto, single = result["machine"], result.get("auto"), result.get("single")
    title = "# Prompt lookup: acceptance by match length" + (", and auto keeping an estimate for each" if auto else "")
    lines = [title, "",
             f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}; the pair "
             f"`{Path(result['pair']).name}`. Command: `.venv/bin/python benchmarks/lookup_match.py --pair PAIR`.", "",
             "Lookup alone, one candidate a round, drafting only where the longest match has n tokens (24 "
             "prompts: the first 12 code and summarisation prompts, 64 new tokens): accepted / proposed.", "",
             "| decoding | " + " | ".join(f"n = {n}" for n in LENGTHS) + " |", "|---|" + "---|" * len(LENGTHS)]
    for mode, by_n in result["acceptance"].items():
        lines.append(f"| {MODE_NAMES[mode]} | " + " | ".join(
            f"{a}/{p} = {a / max(p, 1):.2f}" for a, p in (by_n[n] for n in map(str, LENGTHS) if n in by_n)) + " |")
    if single:
        lines += _comparison(single, "single tokens too", "as it is",
                             "Auto whose lookup also matches single tokens against auto as it is (matches of 2 to 4), "
                             f"one run each interleaved per prompt and mode, the order swapped every run "
                             f"({single['prompts']} prompts of benchmarks/llama_cpp.py, each with its seed, 64 new "
                             "tokens): median decode rate (tok/s) and the median of the per-prompt ratios.")
        lines += ["", "Lookup as it is matches 2 tokens at least (`NGRAM_MIN`); the ratios above say whether "
                  "single-token matches paid on this machine."]
    if auto:
        lines += _comparison(auto, "by length", "one estimate",
                             "Auto with an estimate per match length against one estimate for every match, at commit "
                             "c7c8cb5, one run each interleaved per prompt and mode, the order swapped every prompt "
                             f"({auto['prompts']} prompts of benchmarks/llama_cpp.py, each with its seed, 64 new "
                             "tokens): median decode rate (tok/s) and the median of the per-prompt ratios.")
    return "\n".join(lines) + "\n"


def _comparison(block: dict, a_name: str, b_name: str, intro: str) -> list[str]:
    """Rows of two auto variants' decode rates per mode and set, with the median per-prompt ratio."""
    lines = ["", intro, "", f"| decoding | set | {a_name} | {b_name} | {a_name} / {b_name} |", "|---|---|---|---|---|"]
    for mode, runs in block["runs"].items():
        for label in [*dict.fromkeys(block["labels"]), None]:
            keep = [i for i, lab in enumerate(block["labels"]) if label is None or lab == label]
            a = [runs[a_name][i] for i in keep]
            b = [runs[b_name][i] for i in keep]
            ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
            lines.append(f"| {MODE_NAMES[mode]} | {label or 'all'} | {statistics.median(a):.1f} | "
                         f"{statistics.median(b):.1f} | {ratio:.3f}x |")
    return [*lines, "", f"Greedy outputs equal between the two: {block['greedy_equal']} of {block['prompts']} prompts."]


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
