"""Where a target forward's time goes, by kind of operation, at context depth: ONNX Runtime's profiler
over the pair target's graph, with edge-sd's LM-head kernel timed beside it.

    bash scripts/real_pair.sh                      # once: the default pair in engines/
    .venv/bin/python benchmarks/step_profile.py [--depths 0,1024,4096] [--sizes 1,4,16]

Per depth (the news articles' and code prompts' tokens cached, as benchmarks/context_depth.py caches
them) and forward size (1: a decoding step; more: a verification forward), --forwards forwards of that
many positions from the same cached length, after two untimed ones, 2 threads, on two engines over
the same folder in turn: one plain, whose forwards and LM-head kernel (edge_sd/engines/lm_head.py,
where the CPU runs it) are timed, and one whose session ONNX Runtime's profiler records, whose kernels
are summed by kind. The profiler adds to every kernel, the many small ones most: read its kinds as
shares of a forward, not as their unprofiled times.

Writes benchmarks/results/step_profile.{md,json,png}; `--report` writes the table and plot again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

from edge_sd.bench.run import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from context_depth import article_ids, prefill  # noqa: E402

# Kinds of operation, by ONNX Runtime operator type; attention's own products (the global layers'
# grouped form) are named after their node.
KINDS = ("4- and 8-bit products", "attention", "norms", "other")


def kind_of(op: str, name: str) -> str:
    if op == "MatMulNBits":
        return KINDS[0]
    if op in ("GroupQueryAttention", "RotaryEmbedding") or "/grouped/" in name:
        return KINDS[1]
    if "LayerNormalization" in op:
        return KINDS[2]
    return KINDS[3]


class TimedHead:
    """The engine's LM head kernel, timed call by call."""

    def __init__(self, head):
        self.head, self.seconds = head, []

    def __call__(self, hidden, out=None):
        start = time.perf_counter()
        logits = self.head(hidden, out)
        self.seconds.append(time.perf_counter() - start)
        return logits


def measure(pair: Path, depths: list[int], sizes: list[int], forwards: int, threads: int, prefix: str) -> dict:
    import edge_sd.engines.session as session_module
    from edge_sd.layout import CACHE_DIR
    from edge_sd.manifest import load_engine_manifest, load_pair_manifest
    from edge_sd.vocab import Vocab

    folder = pair / load_pair_manifest(pair).target
    m = load_engine_manifest(folder)
    plain = session_module.session_options

    def profiled(*args, **kwargs):
        opts = plain(*args, **kwargs)
        opts.enable_profiling, opts.profile_file_prefix = True, prefix
        return opts

    plain_source = session_module.OrtSession(folder, provider="cpu", threads=threads)
    with mock.patch.object(session_module, "session_options", profiled):
        source = session_module.OrtSession(folder, provider="cpu", threads=threads)
    vocab = Vocab.from_file(folder / m.tokenizer_file, m.eos_token_ids, cache=folder / CACHE_DIR)
    ids = article_ids(type("Target", (), {"vocab": vocab})(), max(depths) + max(sizes) + 1)
    # The same forwards on an engine of each session in turn, as a generator's target
    engines = {name: s.engine(release_window=True) for name, s in (("plain", plain_source), ("profiled", source))}
    for engine in engines.values():
        engine.reserve(max(depths) + max(sizes) + 1)
    head = TimedHead(engines["plain"]._head) if engines["plain"]._head is not None else None
    if head is not None:
        engines["plain"]._head = head
    labels: list[tuple[int, int, int] | None] = []  # per profiled run: (depth, size, forward) or None
    session = source.session
    run = session.run_with_iobinding
    current: list[tuple[int, int, int] | None] = [None]

    def labelled(io, *args, **kwargs):
        labels.append(current[0])
        return run(io, *args, **kwargs)

    session.run_with_iobinding = labelled
    walls: dict[tuple[str, int, int], list[float]] = {}
    heads: dict[tuple[int, int], list[float]] = {}
    for d in depths:
        for engine in engines.values():
            if d:
                prefill(engine, ids[:d])
        for s in sizes:
            for i in range(forwards + 2):
                for name, engine in engines.items():
                    if d:
                        engine.truncate(d)
                    else:
                        engine.reset()
                    current[0] = (d, s, i) if i >= 2 and name == "profiled" else None
                    done = len(head.seconds) if head is not None else 0
                    start = time.perf_counter()
                    engine.forward(ids[d : d + s], scratch=True)
                    wall = time.perf_counter() - start
                    current[0] = None
                    if i >= 2:
                        walls.setdefault((name, d, s), []).append(wall)
                        if name == "plain":
                            heads.setdefault((d, s), []).append(sum(head.seconds[done:]) if head else 0.0)
            print(f"depth {d}, {s} positions: {1e3 * statistics.median(walls[('plain', d, s)]):.2f} ms a forward",
                  file=sys.stderr, flush=True)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"), key=lambda e: e["ts"])
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")),
                   key=lambda e: e["ts"])
    if len(runs) != len(labels):
        sys.exit(f"the profile holds {len(runs)} runs, {len(labels)} were made")
    per: dict[tuple[int, int], dict[str, list[float]]] = {}
    at = 0
    for r, label in zip(runs, labels, strict=True):
        while at < len(nodes) and nodes[at]["ts"] < r["ts"]:
            at += 1
        if label is None:
            continue
        kinds = dict.fromkeys(KINDS, 0.0)
        j = at
        while j < len(nodes) and nodes[j]["ts"] <= r["ts"] + r["dur"]:
            kinds[kind_of(nodes[j]["args"]["op_name"], nodes[j]["name"])] += nodes[j]["dur"] / 1e3
            j += 1
        row = per.setdefault(label[:2], {"run": [], **{k: [] for k in KINDS}})
        row["run"].append(r["dur"] / 1e3)
        for k, v in kinds.items():
            row[k].append(v)
    rows = []
    for (d, s), v in per.items():
        rows.append({"depth": d, "positions": s, "wall_ms": 1e3 * statistics.median(walls[("plain", d, s)]),
                     "profiled_wall_ms": 1e3 * statistics.median(walls[("profiled", d, s)]),
                     "head_ms": 1e3 * statistics.median(heads[(d, s)]),
                     "run_ms": statistics.median(v["run"]), **{k: statistics.median(v[k]) for k in KINDS}})
    return {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": pair.name,
            "head": "edge-sd's kernel" if head is not None else "the graph's", "threads": threads,
            "forwards": forwards, "rows": rows}


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Where a target forward's time goes", "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}; the pair "
        f"`{result['pair']}`'s target, {result['threads']} threads, the LM head computed by "
        f"{result['head']}. Command: `.venv/bin/python benchmarks/step_profile.py`. Two engines over "
        "the same folder take turns forward by forward, one of them profiled; median of "
        f"{result['forwards']} forwards each. Forward and LM head kernel: the unprofiled engine's. "
        "Profiled: its forward, ONNX Runtime's run, and the run's kernels by kind as the profiler "
        "times them (it adds to every kernel, the many small ones most: read the kinds as shares).", "",
        "| cached positions | positions a forward | forward, ms | LM head kernel, ms | rest, ms | "
        "profiled: forward, ms | run, ms | " + " | ".join(f"{k}, ms" for k in KINDS) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(KINDS),
    ]
    for r in result["rows"]:
        lines.append(f"| {r['depth']} | {r['positions']} | {r['wall_ms']:.2f} | {r['head_ms']:.2f} | "
                     f"{r['wall_ms'] - r['head_ms']:.2f} | {r['profiled_wall_ms']:.2f} | {r['run_ms']:.2f} | "
                     + " | ".join(f"{r[k]:.2f}" for k in KINDS) + " |")
    at = {(r["depth"], r["positions"]): r for r in result["rows"]}
    d0, d1 = min(at)[0], max(at)[0]
    one, deep = at.get((d0, 1)), at.get((d1, 1))
    if one is not None and deep is not None and d1 > d0:
        kernels = sum(one[k] for k in KINDS)
        lines += ["", f"A step after {d0} cached positions: the 4- and 8-bit products "
                  f"{one[KINDS[0]] / kernels:.0%} of the profiled kernels, attention {one[KINDS[1]] / kernels:.0%}; "
                  f"the LM head's kernel {one['head_ms']:.2f} of {one['wall_ms']:.2f} ms. After {d1}: the step "
                  f"takes {deep['wall_ms'] - one['wall_ms']:+.2f} ms, and attention "
                  f"{deep[KINDS[1]] - one[KINDS[1]]:+.2f} ms profiled."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for k in (*KINDS, "LM head kernel"):  # the head as the unprofiled engine took it
        v = np.array([r["head_ms"] if k == "LM head kernel" else r[k] for r in rows])
        ax.bar(x, v, bottom=bottom, label=k)
        bottom += v
    ax.set_xticks(x, [f"{r['depth']}\n{r['positions']} pos." for r in rows], fontsize=8)
    ax.set_xlabel("cached positions / positions a forward")
    ax.set_ylabel("ms (kernels profiled)")
    ax.set_title("Target forward by kind of operation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--depths", default="0,1024,4096")
    ap.add_argument("--sizes", default="1,4,16", help="positions a forward")
    ap.add_argument("--forwards", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="only write the table and plot again from the JSON")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "step_profile", report, plot))
        return
    depths = [int(d) for d in args.depths.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(d % 64 for d in depths) or max(sizes) > 64:
        ap.error("depths must be multiples of 64 and sizes at most 64 (a forward across a multiple of 64 "
                 "runs in two parts)")
    with tempfile.TemporaryDirectory() as tmp:  # the profiler's trace, read and dropped
        result = measure(args.pair, depths, sizes, args.forwards, args.threads, str(Path(tmp) / "trace"))
    print(write_results(args.out, "step_profile", report, plot, result))


if __name__ == "__main__":
    main()
