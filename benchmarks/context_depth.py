"""Decode rate against context depth and prefill of long prompts: the pair's target stepping one token
at a time after d cached positions, beside llama.cpp's `llama-bench` generating after d positions
(`-d`) of the same GGUF file; prefill of p prompt positions beside `llama-bench -p p`.

    bash scripts/real_pair.sh                      # once: the default pair in engines/
    LLAMA_BIN=$(bash benchmarks/llama_cpp.sh)      # once: llama.cpp's tools (about 10 minutes)
    .venv/bin/python benchmarks/context_depth.py --llama-bin "$LLAMA_BIN" [--depths 0,1024,2048,4096,8192]
        [--prefill 512,2048,8192] [--memory]

Per repeat and depth, one after the other: edge-sd's target (the pair folder's, through an engine as
a generator's target uses it: the prompt's positions prefilled in chunks, then --tokens one-position
forwards, each fed the argmax of the one before) and `llama-bench -p 0 -n TOKENS -d DEPTH -r 1`; then
per prompt length, edge-sd's chunked prefill and `llama-bench -p P -n 0 -r 1`. The text is the news
articles' one after the other and then HumanEval's prompts, cut to the length. Rates are medians
over --repeats; the ratio is edge-sd over llama.cpp. --memory runs each tool once more per depth,
alone in a process, for its peak resident memory.
What it shows is how a step's cost grows with the positions it attends to: per layer, over every cached
position or (a sliding-window layer) over the window only.

Writes benchmarks/results/context_depth.{md,json,png}; `--report` writes the table and plot again from
the JSON, without running anything.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from edge_sd.bench.llama_cpp import in_large_pages
from edge_sd.bench.llama_cpp import version as llama_version
from edge_sd.bench.run import machine, write_results
from edge_sd.decoder import PREFILL_AREA, PREFILL_CHUNK, prefill_stop
from edge_sd.manifest import load_engine_manifest, load_pair_manifest
from edge_sd.model import Model
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def prefill(engine, ids: list[int]) -> float:
    """Seconds to cache `ids` as a generator's prefill does: in chunks (decoder.prefill_stop), the
    last row's logits read."""
    engine.reset()
    start = time.perf_counter()
    at = 0
    while at < len(ids):
        stop = prefill_stop(at, len(ids))
        engine.forward(np.asarray(ids[at:stop]), last=1, scratch=True)
        at = stop
    return time.perf_counter() - start


def edge_rate(engine, ids: list[int], depth: int, tokens: int) -> float:
    """Tokens a second of `tokens` one-position steps after `depth` cached positions."""
    if depth:
        prefill(engine, ids[:depth])
    else:
        engine.reset()
    tok = ids[depth]
    spent = 0.0
    for _ in range(tokens):
        start = time.perf_counter()
        tok = int(np.argmax(engine.forward(np.asarray([tok]), scratch=True)[0]))
        spent += time.perf_counter() - start
    return tokens / spent


def memory_of(pid: int, field: str = "VmHWM") -> int:
    """A field of the process's memory status in bytes: VmHWM, its peak resident memory so far (its
    own address space's, where getrusage's ru_maxrss keeps the forking parent's peak across exec), or
    VmRSS, what is resident now; 0 once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith(field + ":")), 0)


def llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, tokens: int, depth: int) -> tuple[float, int]:
    """llama-bench's rate (tokens a second) for one run and its peak resident memory in bytes."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(tokens), "-d", str(depth),
           "-r", "1", "-o", "json"]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        peak = 0
        while proc.poll() is None:  # the peak is reached at the start and at the end of the run
            peak = max(peak, memory_of(proc.pid))
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{err.read().decode()[-2000:]}")
        return float(json.loads(out.read())[0]["avg_ts"]), peak


def edge_memory(pair: Path, depth: int, tokens: int, threads: int) -> dict:
    """What a process that loads the pair's target alone, caches `depth` positions of the text and
    steps `tokens` positions (as a generator's target does, window memory given back) holds: its
    peak resident memory in bytes, what it holds after the steps, and that by kind of mapping
    (memory_parts)."""
    return json.loads(_child(pair, ["--memory-child", str(depth), "--tokens", str(tokens), "--threads", str(threads)]))


def tokenizer_memory(pair: Path) -> int:
    """Bytes a process holds for the target's tokenizer (Vocab, read from its runtime cache) alone."""
    return int(_child(pair, ["--memory-child-tokenizer"]))


def _child(pair: Path, options: list[str]) -> str:
    proc = subprocess.run([sys.executable, __file__, "--pair", str(pair), *options],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        sys.exit(f"the memory run {' '.join(options)} failed:\n{proc.stderr[-2000:]}")
    return proc.stdout.splitlines()[-1]


def memory_parts(pair: Path) -> dict[str, int]:
    """This process's resident bytes by kind of mapping (/proc/self/smaps): the engine's files as
    ONNX Runtime maps them (its weights, prepacked, and the tables read from them), shared libraries
    and the interpreter, and the rest (heap and anonymous memory: the KV cache, the tokenizer, ONNX
    Runtime's buffers, Python's objects)."""
    parts = {"engine files": 0, "libraries": 0, "heap and anonymous": 0}
    kind = "heap and anonymous"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
            name = fields[5] if len(fields) > 5 else ""
            kind = ("engine files" if name.startswith(str(pair.resolve())) else
                    "libraries" if name.startswith("/") else "heap and anonymous")
        elif fields and fields[0] == "Rss:":
            parts[kind] += int(fields[1]) * 1024
    return parts


def memory_child(pair: Path, depth: int, tokens: int, threads: int) -> None:
    pm = load_pair_manifest(pair)
    target = Model.load(pair / pm.target, threads=threads).target
    ids = article_ids(target, depth + tokens + 1)
    engine = target.session.engine(release_window=True)
    engine.reserve(depth + tokens + 1)
    edge_rate(engine, ids, depth, tokens)
    print(json.dumps({"peak": memory_of(os.getpid()), "after": memory_of(os.getpid(), "VmRSS"),
                      "parts": memory_parts(pair)}))


def tokenizer_child(pair: Path) -> None:
    from edge_sd.layout import CACHE_DIR
    from edge_sd.vocab import Vocab

    folder = pair / load_pair_manifest(pair).target
    m = load_engine_manifest(folder)
    before = memory_of(os.getpid(), "VmRSS")
    _vocab = Vocab.from_file(folder / m.tokenizer_file, m.eos_token_ids, cache=folder / CACHE_DIR)  # held
    print(memory_of(os.getpid(), "VmRSS") - before)


def article_ids(target, need: int) -> list[int]:
    """The news articles' ids one after the other, then the code prompts', at least `need` of them."""
    texts = prompt_sets.articles(cache_dir(), 10**6) + [p.text for p in prompt_sets.load("code", cache_dir(), 164)]
    ids: list[int] = []
    for text in texts:
        ids += target.vocab.encode_text(text + "\n\n")
        if len(ids) >= need:
            return ids
    sys.exit(f"the news articles and code prompts make {len(ids)} tokens, fewer than the {need} needed")


def measure_memory(args, bench: Path, gguf: Path, depths: list[int]) -> dict[str, dict]:
    memory: dict[str, dict] = {}
    for d in depths:
        edge = edge_memory(args.pair, d, args.tokens, args.threads)
        memory[str(d)] = {"edge-sd": edge["peak"], "edge-sd after": edge["after"], "edge-sd parts": edge["parts"],
                          "llama.cpp": llama_bench(bench, gguf, args.threads, 0, args.tokens, d)[1]}
        print(f"memory at depth {d}: edge-sd {edge['peak'] / 2**20:.0f} MiB peak, {edge['after'] / 2**20:.0f} MiB "
              f"after, llama.cpp {memory[str(d)]['llama.cpp'] / 2**20:.0f} MiB peak", file=sys.stderr, flush=True)
    memory["tokenizer"] = {"edge-sd": tokenizer_memory(args.pair)}
    return memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--llama-bin", type=Path, help="folder of llama.cpp's binaries (llama_cpp.sh)")
    ap.add_argument("--report", action="store_true", help="only write the table and plot again from the JSON")
    ap.add_argument("--gguf", type=Path, help="the GGUF file [the pair target's source]")
    ap.add_argument("--depths", default="0,1024,2048,4096,8192")
    ap.add_argument("--prefill", default="512,2048,8192", help="prompt lengths whose prefill is timed ('' for none)")
    ap.add_argument("--memory", action="store_true",
                    help="also each tool's peak resident memory at each depth, in a process of its own")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--memory-only", action="store_true",
                    help="measure the memory alone, at the depths of the JSON written before, and add it there")
    ap.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--memory-child-tokenizer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.memory_child is not None:
        memory_child(args.pair, args.memory_child, args.tokens, args.threads)
        return
    if args.memory_child_tokenizer:
        tokenizer_child(args.pair)
        return
    if args.report:
        write_results(args.out, "context_depth", report, plot)
        return
    if args.llama_bin is None:
        ap.error("--llama-bin is required (bash benchmarks/llama_cpp.sh builds llama.cpp and prints it)")
    depths = [int(d) for d in args.depths.split(",")]
    prompts = [int(p) for p in args.prefill.split(",") if p]
    bench = args.llama_bin / "llama-bench"
    if not bench.is_file():
        sys.exit(f"{bench} not found (bash benchmarks/llama_cpp.sh builds it and prints its folder)")
    pm = load_pair_manifest(args.pair)
    manifest = load_engine_manifest(args.pair / pm.target)
    gguf = args.gguf or Path(manifest.source)
    if not gguf.is_file():
        sys.exit(f"GGUF file {gguf} not found (--gguf)")
    in_large_pages(gguf)  # llama-bench maps it: in the state edge-sd's load keeps its own weights
    if args.memory_only:  # each memory run loads the target in a process of its own
        result = json.loads((args.out / "context_depth.json").read_text())
        result["memory"] = measure_memory(args, bench, gguf, [int(d) for d in result["runs"]])
        print(write_results(args.out, "context_depth", report, plot, result))
        return
    need = max(depths + prompts) + args.tokens + 1
    if need > manifest.max_context:
        sys.exit(f"{need} positions pass the target's context ({manifest.max_context} positions)")
    target = Model.load(args.pair, threads=args.threads).target
    ids = article_ids(target, need)
    engine = target.session.engine(release_window=True)  # as a generator's target
    engine.reserve(need)
    edge_rate(engine, ids, min(depths), 4)  # warm-up: the first forwards of each shape
    runs: dict[int, dict[str, list[float]]] = {d: {"edge-sd": [], "llama.cpp": []} for d in depths}
    fills: dict[int, dict[str, list[float]]] = {p: {"edge-sd": [], "llama.cpp": []} for p in prompts}
    memory: dict[str, dict] = {}
    for r in range(args.repeats):
        for d in depths:
            runs[d]["edge-sd"].append(edge_rate(engine, ids, d, args.tokens))
            runs[d]["llama.cpp"].append(llama_bench(bench, gguf, args.threads, 0, args.tokens, d)[0])
            print(f"[{r + 1}/{args.repeats}] depth {d}: edge-sd {runs[d]['edge-sd'][-1]:.1f}, "
                  f"llama.cpp {runs[d]['llama.cpp'][-1]:.1f} tok/s", file=sys.stderr, flush=True)
        for p in prompts:
            fills[p]["edge-sd"].append(p / prefill(engine, ids[:p]))
            fills[p]["llama.cpp"].append(llama_bench(bench, gguf, args.threads, p, 0, 0)[0])
            print(f"[{r + 1}/{args.repeats}] prefill {p}: edge-sd {fills[p]['edge-sd'][-1]:.0f}, "
                  f"llama.cpp {fills[p]['llama.cpp'][-1]:.0f} positions/s", file=sys.stderr, flush=True)
    if args.memory:
        memory = measure_memory(args, bench, gguf, depths)
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "target": pm.target, "gguf": gguf.name, "sliding_window": manifest.sliding_window,
              "prefill_chunks": f"{PREFILL_CHUNK} positions, halved down to 64 while chunk x (cached + chunk) "
                                f"exceeds {PREFILL_AREA}",
              "window_granule": manifest.window_views.get("granule", 0),
              "grouped_attention": manifest.grouped_attention,
              "llama_cpp": llama_version(args.llama_bin), "options": {k: str(v) for k, v in vars(args).items()},
              "runs": {str(d): v for d, v in runs.items()}, "prefill": {str(p): v for p, v in fills.items()},
              "memory": memory}
    print(write_results(args.out, "context_depth", report, plot, result))


def report(result: dict) -> str:
    m = result["machine"]
    o = result["options"]
    memory = result.get("memory") or {}
    lines = [
        "# Decode and prefill against context depth: edge-sd and llama.cpp",
        "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}, "
        f"llama.cpp {result['llama_cpp']}; {o['threads']} threads each. {result['gguf']}: edge-sd's "
        f"`{result['target']}` engine of the pair (as a generator's target: prefill in chunks of "
        f"{result.get('prefill_chunks', '512 positions')}, sliding-window views in steps of "
        f"{result.get('window_granule', '?')} positions) "
        f"against llama.cpp's `llama-bench`, {o['tokens']} tokens after each depth, median of {o['repeats']} "
        f"interleaved repeats (`benchmarks/context_depth.py`). The model's sliding window: "
        f"{result['sliding_window']} positions.",
        "",
        "| cached positions | edge-sd tok/s | llama.cpp tok/s | edge-sd / llama.cpp |"
        + (" edge-sd peak / after, MiB | llama.cpp peak, MiB |" if memory else ""),
        "|---|---|---|---|" + ("---|---|" if memory else ""),
    ]
    for d, v in result["runs"].items():
        e, c = statistics.median(v["edge-sd"]), statistics.median(v["llama.cpp"])
        row = f"| {d} | {e:.1f} | {c:.1f} | {e / c:.2f}x |"
        if d in memory:
            mib = {k: f"{v / 2**20:.0f}" for k, v in memory[d].items() if isinstance(v, int)}
            row += f" {mib['edge-sd']} / {mib.get('edge-sd after', '-')} | {mib['llama.cpp']} |"
        lines.append(row)
    if result.get("prefill"):
        lines += ["", "| prompt positions | edge-sd prefill, positions/s | llama.cpp (`-p`) | edge-sd / llama.cpp |",
                  "|---|---|---|---|"]
        for p, v in result["prefill"].items():
            e, c = statistics.median(v["edge-sd"]), statistics.median(v["llama.cpp"])
            lines.append(f"| {p} | {e:.0f} | {c:.0f} | {e / c:.2f}x |")
    if memory:
        lines += ["", "Resident memory: each tool alone in a process of its own at each depth (edge-sd's target",
                  "without the drafter, llama-bench with its context sized to the depth and tokens); the peak",
                  "(VmHWM, polled for llama-bench) and, for edge-sd, what it held after the steps (VmRSS)."]
        parts = {d: v["edge-sd parts"] for d, v in memory.items() if "edge-sd parts" in v}
        if parts:
            kinds = list(next(iter(parts.values())))
            lines += ["", "What edge-sd held after the steps, by kind of mapping (/proc/self/smaps), MiB:", "",
                      "| cached positions | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
            lines += [f"| {d} | " + " | ".join(f"{p[k] / 2**20:.0f}" for k in kinds) + " |" for d, p in parts.items()]
            lines += ["", "Engine files: the weights as ONNX Runtime prepacked them into its optimized graph's data "
                      "file, mapped (the LM head's 6-bit values in 8-bit blocks), and the pages of the embedding "
                      "table and rotary tables that the text touched."]
            if "tokenizer" in memory:
                lines += [f"Of the heap, the target's tokenizer alone (read in a process of its own): "
                          f"{memory['tokenizer']['edge-sd'] / 2**20:.0f} MiB."]
    lines += [
        "",
        "Where the rates fall: an attention kernel scores every position of the cache it is given. edge-sd",
        "gives a `gguf` target's sliding-window layers a view of their cache from at most a window and a",
        "granule before the forward (manifest `window_views`; without it, the whole cache) and its global",
        "layers the whole cache, in fp32" + (
            ", each read once a step for all query heads (manifest `grouped_attention`, layers "
            + ", ".join(map(str, result["grouped_attention"])) + ")" if result.get("grouped_attention") else
            " (GroupQueryAttention's CPU kernel reads it once per query head)") + ".",
        "llama.cpp (by default) keeps a sliding-window layer's cache to its window and stores keys and",
        "values in fp16.",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("runs", "cached positions before the tokens timed", "decode rate, tok/s (median)")]
    if result.get("prefill"):
        panels.append(("prefill", "prompt positions", "prefill, positions/s (median)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (key, xlabel, ylabel) in zip(axes[0], panels, strict=True):
        xs = [int(x) for x in result[key]]
        for tool, color in (("edge-sd", "tab:blue"), ("llama.cpp", "tab:orange")):
            ax.plot(xs, [statistics.median(v[tool]) for v in result[key].values()], "o-", color=color, label=tool)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.suptitle(f"{result['gguf']}, {result['machine']['cores']} cores, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
