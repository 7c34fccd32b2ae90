"""auto as a new user meets it: each generation on a freshly loaded pair, nothing learnt before.

    bash scripts/real_pair.sh                 # once: installs, exports engines/gemma3-270m_smollm2-135m
    .venv/bin/python benchmarks/first_run.py [--pair DIR] [--skip 4] [--per-set 4] [-n 48]

`edge-sd bench` keeps one pipeline for all prompts, so auto's cost model carries what it learnt from
one prompt to the next. A user running `edge-sd generate` once has none of that: the pipeline is
loaded, the cost model calibrated in a few forwards, and acceptance starts from its prior. Here every
speculative generation (auto, and a fixed configuration for each mode) gets a pipeline of its own,
against plain decoding of the same target engine (one pipeline, loaded once: loading is not timed);
the speedup is the median of per-prompt ratios, as in the benchmark. Writes
benchmarks/results/first_run.{md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "engines" / "gemma3-270m_smollm2-135m"
OUT = ROOT / "benchmarks" / "results" / "first_run"
# Each mode's fixed configuration to compare with: the README's advice for it.
MODES = {"greedy": (0.0, "slem", 3), "sampling": (1.0, "slrs", 1)}


def rate(pipe, text: str, cfg) -> float:
    """Tokens per second of one generation."""
    return pipe.generate(text, cfg).stats.tokens_per_second


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=PAIR)
    ap.add_argument("--skip", type=int, default=4)
    ap.add_argument("--per-set", type=int, default=4)
    ap.add_argument("-n", type=int, default=48)
    args = ap.parse_args()

    from edge_sd.manifest import load_pair_manifest
    from edge_sd.pipeline import GenerationConfig, Pipeline
    from edge_sd.tools import prompt_sets

    cache = cache_dir()
    plist = [p for s in ("code", "summarisation")
             for p in prompt_sets.load(s, cache, args.skip + args.per_set)[args.skip:]]
    plain = Pipeline.from_folder(args.pair / load_pair_manifest(args.pair).target)
    plain.generate(plist[0].text, GenerationConfig(max_new_tokens=4, algorithm="ar"))  # warm-up
    ratios: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for mode, (temperature, algo, k) in MODES.items():
        for i, prompt in enumerate(plist):
            for label, kw in (("plain", {"algorithm": "ar"}), ("auto", {}),
                              (f"{algo} k={k}", {"algorithm": algo, "lookahead": k})):
                cfg = GenerationConfig(max_new_tokens=args.n, temperature=temperature, seed=i, **kw)
                if label == "plain":
                    base = rate(plain, prompt.text, cfg)
                    continue
                ratios.setdefault((mode, label), []).append((prompt.set, rate(Pipeline.from_folder(args.pair),
                                                                               prompt.text, cfg) / base))
            print(f"{mode} {prompt.id}: " + ", ".join(f"{lab} {r[-1][1]:.2f}x" for (m, lab), r in ratios.items()
                                                       if m == mode), flush=True)

    def median(rows: list[tuple[str, float]], subset: str | None = None) -> float:
        return statistics.median(r for s, r in rows if subset in (None, s))

    lines = [
        f"Command: `python benchmarks/first_run.py --skip {args.skip} --per-set {args.per_set} -n {args.n}` "
        f"({datetime.date.today()}); pair `{args.pair.name}`; prompts {args.skip + 1}-{args.skip + args.per_set} of "
        "each set; every speculative generation on a freshly loaded pipeline (auto calibrates its costs at load, "
        "acceptance from its prior), plain decoding on one pipeline loaded once. Speedup: median of per-prompt "
        "ratios against plain decoding of the same target engine.",
        "",
        "| mode | configuration | speedup (median) | code | news |",
        "|---|---|---|---|---|",
    ]
    for (mode, label), rows in ratios.items():
        lines.append(f"| {mode} | {label} | {median(rows):.2f}x | {median(rows, 'code'):.2f}x | "
                     f"{median(rows, 'summarisation'):.2f}x |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    labels = [f"{mode}\n{label}" for mode, label in ratios]
    ax.bar(labels, [median(rows) for rows in ratios.values()])
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("first generation on a fresh pipeline")
    fig.tight_layout()
    fig.savefig(OUT.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
