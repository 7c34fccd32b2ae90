"""The target's decode rate with its runtime cache's weights in small pages and in large pages.

    .venv/bin/python benchmarks/large_pages.py [--pair PAIR] [--rounds 3] [--depths 0,2048]

Each round, twice: the weights file of the target's runtime cache is dropped from the page cache,
then a fresh process loads the target. With EDGE_SD_LARGE_PAGES=0 its mappings fault the file back
in 4 KiB pages ("small"); by default the load finds them small, reads the file again into large
folios and builds its session again ("re-read", engines/large_pages.py). Each process then steps
--tokens one-position forwards after each depth (the prompt prefilled as a generator does, the
argmax fed back) and reports its rates, the share of the file's resident mapping in 2 MiB entries,
and its load time (the re-read included). Linux only.

Writes benchmarks/results/large_pages.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATES = {"small": "0", "re-read": "1"}


def child(pair: Path, depths: list[int], tokens: int) -> None:
    """One load of the pair's target and its decode rates; prints a JSON line."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import context_depth

    from edge_sd.engines import large_pages
    from edge_sd.layout import CACHE_DIR, DATA, ORT_DIR
    from edge_sd.model import Model

    start = time.perf_counter()
    model = Model.load(pair)
    engine = model.target.engine
    loaded = time.perf_counter() - start
    held = large_pages.residency(model.target.session.folder / CACHE_DIR / ORT_DIR / DATA)
    engine.reserve(max(depths) + tokens + 1)
    ids = context_depth.article_ids(model.target, max(depths) + 1)
    rates = {str(d): context_depth.edge_rate(engine, ids, d, tokens) for d in depths}
    print(json.dumps({"load_s": loaded, "share": None if held is None else held.share, "rates": rates,
                      "notes": model.notes}))


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", default="0,2048")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    if args.child:
        child(args.pair, depths, args.tokens)
        return
    from edge_sd.bench.run import machine, write_results

    if args.report:
        print(write_results(args.out, "large_pages", report, plot))
        return
    from edge_sd.layout import CACHE_DIR, DATA, ORT_DIR
    from edge_sd.manifest import load_pair_manifest

    target = args.pair / load_pair_manifest(args.pair).target
    data = target / CACHE_DIR / ORT_DIR / DATA
    marker = data.parent / "large_pages.json"
    runs: dict[str, list[dict]] = {state: [] for state in STATES}
    for r in range(args.rounds):
        for state in list(STATES)[:: 1 if r % 2 == 0 else -1]:
            if not data.is_file():
                sys.exit(f"{data}: no runtime cache (load the pair once first)")
            drop(data)
            marker.unlink(missing_ok=True)
            env = {**os.environ, "EDGE_SD_LARGE_PAGES": STATES[state]}
            out = subprocess.run([sys.executable, __file__, "--pair", str(args.pair), "--depths", args.depths,
                                  "--tokens", str(args.tokens), "--child"], env=env, capture_output=True,
                                 text=True, check=True).stdout
            runs[state].append(json.loads(out.strip().splitlines()[-1]))
            print(state, runs[state][-1], file=sys.stderr, flush=True)
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "tokens": args.tokens, "depths": depths, "runs": runs}
    print(write_results(args.out, "large_pages", report, plot, result))


def report(result: dict) -> str:
    m, runs = result["machine"], result["runs"]

    def med(state: str, key: str, depth: int | None = None) -> float:
        return statistics.median(r["rates"][str(depth)] if depth is not None else r[key] for r in runs[state])

    lines = ["# The target's weights in small and large pages", "",
             f"{result['date']}, {m['cpu']} ({m['cores']} cores), {m['platform']}, ONNX Runtime {m['onnxruntime']}; "
             f"the pair `{Path(result['pair']).name}`. Command: `.venv/bin/python benchmarks/large_pages.py --pair "
             f"PAIR`. {len(runs['small'])} rounds, the two states in turn, each a fresh process after the runtime "
             f"cache's weights file left the page cache; {result['tokens']} one-position steps after each depth, "
             "2 threads; medians.", "",
             "| state | share in 2 MiB entries | load (s) | " + " | ".join(
                 f"tok/s after {d}" for d in result["depths"]) + " |",
             "|---|---|---|" + "---|" * len(result["depths"])]
    for state in runs:
        lines.append(f"| {state} | {med(state, 'share'):.2f} | {med(state, 'load_s'):.2f} | " + " | ".join(
            f"{med(state, '', d):.1f}" for d in result["depths"]) + " |")
    pairs = list(zip(runs["small"], runs["re-read"], strict=True))
    lines += ["", "re-read / small: " + ", ".join(
        f"{statistics.median(b['rates'][str(d)] / a['rates'][str(d)] for a, b in pairs):.2f}x after {d}"
        for d in result["depths"]) + " (median of the rounds' ratios)."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    depths = result["depths"]
    for j, (state, runs) in enumerate(result["runs"].items()):
        ax.bar([i + 0.4 * j for i in range(len(depths))],
               [statistics.median(r["rates"][str(d)] for r in runs) for d in depths], 0.4, label=state)
    ax.set_xticks([i + 0.2 for i in range(len(depths))], [f"after {d}" for d in depths])
    ax.set_ylabel("decode rate, tok/s (median)")
    ax.legend()
    fig.suptitle(f"{Path(result['pair']).name}, {result['machine']['cores']} cores, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
