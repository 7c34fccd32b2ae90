"""What choosing a token costs: the sampler chain on the pair target's real logits rows, per filter, beside
the full-row sort it replaced.

    bash scripts/real_pair.sh                      # once: the default pair in engines/
    .venv/bin/python benchmarks/sampler.py [--rows 64] [--repeats 5]

The rows are the target's logits over the first news articles and code prompts (262,144 entries each
for Gemma 3). Each setting draws one token from every row, `--repeats` times, interleaved with the other
settings; the figure is the median time of one draw, penalties counting the 64 tokens before the row.
"full-row sort" is top-p as edge-sd computed it before 2026-12-04 (an argsort of the whole float64
row), for comparison.

Writes benchmarks/results/sampler.{md,json,png}; `--report` writes the table and plot again from the
JSON.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import numpy as np

from edge_sd.bench.run import CHAT, machine, write_results
from edge_sd.model import Model
from edge_sd.sampling import Dist, SamplingConfig, chain, draw, penalize, sample
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "greedy (argmax)": SamplingConfig(),
    "T=1, no filters": SamplingConfig(1.0),
    "T=0.8, top-k 40": SamplingConfig(0.8, top_k=40),
    "T=0.8, top-p 0.95": SamplingConfig(0.8, top_p=0.95),
    "T=0.8, min-p 0.05": SamplingConfig(0.8, min_p=0.05),
    "T=0.8, top-k 40, top-p 0.95": SamplingConfig(0.8, top_k=40, top_p=0.95),
    "chat: T=0.8, top-k 40, top-p 0.95, min-p 0.05": CHAT,
    "chat + repetition 1.1, presence 0.5, frequency 0.5 over 64": SamplingConfig(
        0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "greedy + repetition 1.1 over 64": SamplingConfig(repetition_penalty=1.1),
}
BEFORE = "T=0.8, top-p 0.95, full-row sort"


def full_sort_top_p(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Top-p over the whole row sorted, as edge-sd's sampler computed it before the chain."""
    x = logits.astype(np.float32) / np.float32(temperature)
    x -= x.max()
    p = np.exp(x).astype(np.float64)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    sorted_p = p[order]
    keep = np.zeros(len(p), dtype=bool)
    keep[order] = (np.cumsum(sorted_p) - sorted_p) < top_p
    p = np.where(keep, p, 0.0)
    return sample(p / p.sum(), rng)


def kept(dist: Dist) -> int:
    """How many tokens a distribution can emit."""
    return int(np.count_nonzero(dist.weights))


def one(setting: str, row: np.ndarray, window: list[int], rng: np.random.Generator) -> float:
    start = time.perf_counter()
    if setting == BEFORE:
        full_sort_top_p(row, 0.8, 0.95, rng)
    else:
        cfg = SETTINGS[setting]
        if cfg.greedy:
            int(np.argmax(penalize(row, cfg, cfg.window(window))))
        else:
            draw(row, cfg, rng, cfg.window(window))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "sampler", report, plot))
        return
    model = Model.load(args.pair, threads=2)
    target, vocab = model.target, model.target.vocab
    texts = prompt_sets.articles(cache_dir(), 2) + [p.text for p in prompt_sets.load("code", cache_dir(), 2)]
    rows, windows = [], []
    engine = target.session.engine()
    per_text = -(-args.rows // len(texts))
    for text in texts:
        ids = vocab.encode_text(text)[:256]
        engine.reset()
        logits = engine.forward(np.asarray(ids))  # [n, V]
        for i in np.linspace(min(64, len(ids) - 1), len(ids) - 1, per_text).astype(int):
            rows.append(np.array(logits[i, : target.manifest.scored_ids], dtype=np.float32))
            windows.append(ids[: i + 1])
    rows, windows = rows[: args.rows], windows[: args.rows]
    time.sleep(1.0)  # ONNX Runtime's threads stop spinning
    settings = [*SETTINGS, BEFORE]
    times: dict[str, list[float]] = {s: [] for s in settings}
    rng = np.random.default_rng(0)
    for _ in range(args.repeats):
        for row, window in zip(rows, windows, strict=True):
            for s in settings:
                times[s].append(one(s, row, window, rng))
    survivors = {s: statistics.median(kept(chain(r, cfg, cfg.window(w))) for r, w in zip(rows, windows, strict=True))
                 for s, cfg in SETTINGS.items() if not cfg.greedy}
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "vocab": int(len(rows[0])), "rows": len(rows), "repeats": args.repeats,
              "ms": {s: 1e3 * statistics.median(t) for s, t in times.items()}, "survivors": survivors}
    print(write_results(args.out, "sampler", report, plot, result))


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# The sampler chain's cost per token",
        "",
        f"{result['date']}; {m['cpu']}, {m['cores']} cores; the target's logits over {result['rows']} positions of "
        f"news and code ({result['vocab']:,} entries a row), each setting {result['repeats']} times, interleaved; "
        "median time of one draw. Command: `python benchmarks/sampler.py`. Every setting reads a row in "
        "turn, so all but the first find it in the CPU's caches; in the decoding loop a row comes fresh "
        "from ONNX Runtime's threads, and reading it costs more.",
        "",
        "| setting | ms a token | tokens kept (median) |",
        "|---|---|---|",
    ]
    for s, ms in result["ms"].items():
        kept = result["survivors"].get(s)
        lines.append(f"| {s} | {ms:.3f} | {'' if kept is None else f'{kept:,.0f}'} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["ms"])
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.barh(labels, [result["ms"][s] for s in labels],
            color=["tab:gray" if s == BEFORE else "tab:blue" for s in labels])
    ax.set_xscale("log")
    ax.set_xlabel("ms to choose a token (median, log scale)")
    ax.invert_yaxis()
    ax.set_title(f"sampler chain over {result['vocab']:,} logits ({result['date']})", fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
