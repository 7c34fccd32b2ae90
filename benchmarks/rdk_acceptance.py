"""Acceptance of TLI and RDK against the drafter's kept vocabulary fraction, on the real pair.

    bash scripts/real_pair.sh                 # once: installs, exports engines/gemma3-270m_smollm2-135m
    .venv/bin/python benchmarks/rdk_acceptance.py [--per-set 8] [-n 48] [--keep 1,0.5,...] [--no-readme]

Expected acceptance per drafted token (sum of min(p, psi), no sampling noise) and greedy hits, along
the target's greedy continuation of each prompt (edge_sd/bench/acceptance.py). Writes
benchmarks/results/rdk_acceptance.{md,json,png} and the README's section. Takes a few minutes: one
target forward per prompt, one drafter step per position, every fraction from the same drafter pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
CACHE = cache_dir()
PAIR = ROOT / "engines" / "gemma3-270m_smollm2-135m"
OUT = ROOT / "benchmarks" / "results"
START, END = "<!-- rdk-acceptance:start -->", "<!-- rdk-acceptance:end -->"
KEYS = ("tli", "rdk", "tli_greedy", "rdk_greedy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=PAIR)
    ap.add_argument("--per-set", type=int, default=8)
    ap.add_argument("--skip", type=int, default=0, help="start each prompt set after this many prompts")
    ap.add_argument("-n", type=int, default=48, help="new tokens per prompt")
    ap.add_argument("--keep", default="1,0.5,0.25,0.1,0.05,0.02")
    ap.add_argument("--no-readme", action="store_true")
    args = ap.parse_args()

    from edge_sd.bench.acceptance import measure, variants
    from edge_sd.bench.run import machine
    from edge_sd.export import prune
    from edge_sd.pipeline import Pipeline
    from edge_sd.tools import prompt_sets as prompts

    fractions = [float(x) for x in args.keep.split(",")]
    plist = [p for s in prompts.SETS for p in prompts.load(s, CACHE, args.skip + args.per_set)[args.skip:]]
    pipe = Pipeline.from_folder(args.pair, threads=2)
    vs = variants(pipe, fractions, prune.corpus_texts(None, CACHE))
    per: dict[float, dict[str, dict[str, list[float]]]] = {f: {} for f in fractions}  # f -> set -> key -> values
    t0 = time.time()
    for i, pr in enumerate(plist):
        got = measure(pipe, pr.text, args.n, vs)
        for f, vals in got.items():
            bucket = per[f].setdefault(pr.set, {k: [] for k in KEYS})
            for k in KEYS:
                bucket[k] += vals[k]
        print(f"[{i + 1}/{len(plist)}] {pr.id} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    rows = []
    for v in vs:
        row: dict = {"keep": v.fraction, "kept": int(len(v.kept)), "kernel_nonzeros": int(len(v.kernel.vals))}
        for k in KEYS:
            every = [x for s in per[v.fraction].values() for x in s[k]]
            row[k] = statistics.fmean(every) if every else None
            row[k + "_by_set"] = {s: statistics.fmean(vals[k]) for s, vals in per[v.fraction].items() if vals[k]}
        row["positions"] = sum(len(s["rdk"]) for s in per[v.fraction].values())
        rows.append(row)
    full = next((r for r in rows if r["keep"] == 1.0), None)
    results = {"options": {**vars(args), "pair": str(args.pair), "kernel": {
        "sample_chunks": prune.SAMPLE_CHUNKS, "chunk_lines": prune.SAMPLE_CHUNK_LINES,
        "sample_top": prune.SAMPLE_TOP, "row_top": prune.ROW_TOP,
        "prior_mass": prune.PRIOR_MASS}},
               "machine": machine(), "prompts": [p.id for p in plist], "rows": rows,
               "date": time.strftime("%Y-%m-%d")}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "rdk_acceptance.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(rows, OUT / "rdk_acceptance.png")
    command = "python benchmarks/rdk_acceptance.py " + " ".join(sys.argv[1:])
    (OUT / "rdk_acceptance.md").write_text(markdown(results, rows, full, command.strip(), ".") + "\n")
    if not args.no_readme:
        from edge_sd.bench.report import update_readme

        update_readme(ROOT / "README.md", markdown(results, rows, full, command.strip(), "benchmarks/results"),
                      START, END)
    print(table(rows, full))


def table(rows: list[dict], full: dict | None) -> str:
    lines = ["| drafter vocab kept | tokens kept | TLI acceptance (T=1) | RDK acceptance (T=1) | RDK / TLI full "
             "| TLI greedy hits | RDK greedy hits | RDK / TLI full (greedy) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['rdk'] / full['tli']:.2f}" if full and r["rdk"] is not None else ""
        ratio_g = f"{r['rdk_greedy'] / full['tli_greedy']:.2f}" if full and r["rdk_greedy"] is not None else ""
        lines.append(f"| {r['keep']:.0%} | {r['kept']} | {r['tli']:.3f} | {r['rdk']:.3f} | {ratio} "
                     f"| {r['tli_greedy']:.3f} | {r['rdk_greedy']:.3f} | {ratio_g} |")
    return "\n".join(lines)


def markdown(results: dict, rows: list[dict], full: dict | None, command: str, image_dir: str) -> str:
    o = results["options"]
    return "\n\n".join([
        f"Command: `{command}` ({results['date']}); {len(results['prompts'])} prompts ({o['per_set']} per set"
        f"{', after the first ' + str(o['skip']) if o['skip'] else ''}), {o['n']} positions each along the target's "
        f"greedy continuation, {rows[0]['positions']} positions in all. The kernel is built from both "
        f"models' distributions in {o['kernel']['sample_chunks']} chunks of {o['kernel']['chunk_lines']} lines of "
        f"each corpus text, wherever both tokenizers end a token (top "
        f"{o['kernel']['sample_top']} entries; at most {o['kernel']['row_top']} restored targets a row). "
        "Acceptance (T=1) is the mean over positions of sum_t min(p(t), psi(t)), "
        "the probability that one drafted token is accepted; greedy hits, the share of positions where the "
        "drafted token is the target's argmax. Kept tokens are ranked on the default corpus (news articles "
        "and Python sources from the gensim wheel), never on these prompts.",
        table(rows, full),
        f"![acceptance against the kept vocabulary]({image_dir}/rdk_acceptance.png)",
    ])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from edge_sd.bench.report import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, (suffix, title) in zip(axes, (("", "sampling (T=1): expected acceptance"),
                                          ("_greedy", "greedy: drafted token = target's argmax")), strict=True):
        for algo, style in (("tli", "-o"), ("rdk", "-s")):
            pts = [(r["keep"], r[algo + suffix]) for r in rows if r[algo + suffix] is not None]
            ax.plot(*zip(*sorted(pts), strict=True), style, label=algo.upper())
        ax.set_xscale("log")
        ax.set_xlabel("drafter vocabulary kept (fraction, log scale)")
        ax.set_ylabel("acceptance per drafted token")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(plt, fig, path)


if __name__ == "__main__":
    main()
