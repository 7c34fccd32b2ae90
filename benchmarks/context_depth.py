"""Decode rate against context depth: the pair's target stepping one token at a time after d cached
positions, beside llama.cpp's `llama-bench` generating after d positions (`-d`) of the same GGUF file.

    bash scripts/real_pair.sh                      # once: the default pair in engines/
    LLAMA_BIN=$(bash benchmarks/llama_cpp.sh)      # once: llama.cpp's tools (about 10 minutes)
    .venv/bin/python benchmarks/context_depth.py --llama-bin "$LLAMA_BIN" [--depths 0,256,512,1024,2048]

Per repeat and depth, one after the other: edge-sd's target (the pair folder's, through its engine as
generators use it: the prompt's positions prefilled, then --tokens one-position forwards, each fed the
argmax of the one before) and `llama-bench -p 0 -n TOKENS -d DEPTH -r 1`. The prefill is the news
articles' text one after the other, cut to the depth. Rates are medians over --repeats; the ratio is
edge-sd over llama.cpp.
What it shows is how a step's cost grows with the positions it attends to: per layer, over every cached
position or (a sliding-window layer) over the window only.

Writes benchmarks/results/context_depth.{md,json,png}; `--report` writes the table and plot again from
the JSON, without running anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from edge_sd.bench.llama_cpp import version as llama_version
from edge_sd.bench.run import machine, write_results
from edge_sd.manifest import load_pair_manifest
from edge_sd.model import Model
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def edge_rate(engine, ids: list[int], depth: int, tokens: int) -> float:
    """Tokens a second of `tokens` one-position steps after `depth` cached positions."""
    engine.reset()
    if depth:
        engine.forward(np.asarray(ids[:depth]), last=1, scratch=True)
    tok = ids[depth]
    spent = 0.0
    for _ in range(tokens):
        start = time.perf_counter()
        tok = int(np.argmax(engine.forward(np.asarray([tok]), scratch=True)[0]))
        spent += time.perf_counter() - start
    return tokens / spent


def llama_rate(binary: Path, gguf: Path, depth: int, tokens: int, threads: int) -> float:
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens), "-d", str(depth),
           "-r", "1", "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return float(json.loads(proc.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--llama-bin", type=Path, help="folder of llama.cpp's binaries (llama_cpp.sh)")
    ap.add_argument("--report", action="store_true", help="only write the table and plot again from the JSON")
    ap.add_argument("--gguf", type=Path, help="the GGUF file [the pair target's source]")
    ap.add_argument("--depths", default="0,256,512,1024,2048")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        write_results(args.out, "context_depth", report, plot)
        return
    if args.llama_bin is None:
        ap.error("--llama-bin is required (bash benchmarks/llama_cpp.sh builds llama.cpp and prints it)")
    depths = [int(d) for d in args.depths.split(",")]
    bench = args.llama_bin / "llama-bench"
    if not bench.is_file():
        sys.exit(f"{bench} not found (bash benchmarks/llama_cpp.sh builds it and prints its folder)")
    model = Model.load(args.pair, threads=args.threads)
    target = model.target
    gguf = args.gguf or Path(target.manifest.source)
    if not gguf.is_file():
        sys.exit(f"GGUF file {gguf} not found (--gguf)")
    need = max(depths) + args.tokens + 1
    if need > target.manifest.max_context:
        sys.exit(f"depth {max(depths)} and {args.tokens} tokens pass the target's context "
                 f"({target.manifest.max_context} positions)")
    ids: list[int] = []
    for text in prompt_sets.articles(cache_dir(), 10**6):
        ids += target.vocab.encode_text(text + "\n\n")
        if len(ids) >= need:
            break
    if len(ids) < need:
        sys.exit(f"the news articles make {len(ids)} tokens, fewer than the {need} needed")
    engine = target.engine
    engine.reserve(need)
    edge_rate(engine, ids, min(depths), 4)  # warm-up: the first forwards of each shape
    runs: dict[int, dict[str, list[float]]] = {d: {"edge-sd": [], "llama.cpp": []} for d in depths}
    for r in range(args.repeats):
        for d in depths:
            runs[d]["edge-sd"].append(edge_rate(engine, ids, d, args.tokens))
            runs[d]["llama.cpp"].append(llama_rate(bench, gguf, d, args.tokens, args.threads))
            print(f"[{r + 1}/{args.repeats}] depth {d}: edge-sd {runs[d]['edge-sd'][-1]:.1f}, "
                  f"llama.cpp {runs[d]['llama.cpp'][-1]:.1f} tok/s", file=sys.stderr, flush=True)
    pm = load_pair_manifest(args.pair)
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "target": pm.target, "gguf": gguf.name, "sliding_window": target.manifest.sliding_window,
              "llama_cpp": llama_version(args.llama_bin), "options": {k: str(v) for k, v in vars(args).items()},
              "runs": {str(d): v for d, v in runs.items()}}
    print(write_results(args.out, "context_depth", report, plot, result))


def report(result: dict) -> str:
    m = result["machine"]
    o = result["options"]
    lines = [
        "# Decode rate against context depth: edge-sd and llama.cpp",
        "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}, "
        f"llama.cpp {result['llama_cpp']}; {o['threads']} threads each. {result['gguf']}: edge-sd's "
        f"`{result['target']}` engine of the pair against llama.cpp's `llama-bench`, {o['tokens']} tokens "
        f"after each depth, median of {o['repeats']} interleaved repeats (`benchmarks/context_depth.py`). "
        f"The model's sliding window: {result['sliding_window']} positions.",
        "",
        "| cached positions | edge-sd tok/s | llama.cpp tok/s | edge-sd / llama.cpp |",
        "|---|---|---|---|",
    ]
    for d, v in result["runs"].items():
        e, c = statistics.median(v["edge-sd"]), statistics.median(v["llama.cpp"])
        lines.append(f"| {d} | {e:.1f} | {c:.1f} | {e / c:.2f}x |")
    lines += [
        "",
        "Where the rates fall: an attention kernel scores every position of the cache it is given. edge-sd",
        "gives a `gguf` target's sliding-window layers a view of their cache from at most a window and a",
        "granule before the forward (manifest `window_views`; without it, the whole cache) and its global",
        "layers the whole cache, in fp32. llama.cpp (by default) keeps a sliding-window layer's cache to its",
        "window and stores keys and values in fp16.",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [int(d) for d in result["runs"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for tool, color in (("edge-sd", "tab:blue"), ("llama.cpp", "tab:orange")):
        ax.plot(depths, [statistics.median(v[tool]) for v in result["runs"].values()], "o-", color=color, label=tool)
    ax.set_xlabel("cached positions before the tokens timed")
    ax.set_ylabel("decode rate, tok/s (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['gguf']}, {result['machine']['cores']} cores, {result['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
