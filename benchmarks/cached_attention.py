"""edge-sd's attention kernel against ONNX Runtime's GroupQueryAttention: one layer alone, then the
pair's target stepping at context depth with each.

    .venv/bin/python benchmarks/cached_attention.py [--pair engines/gemma3-270m_smollm2-135m]
        [--depths 0,1024,2048,4096,8192] [--tokens 32] [--repeats 3] [--against first-form]

Layer: Gemma-3-270M's shapes (4 query heads over one key/value head of 256), a shared fp32 buffer bound
as past and present (as engines/kv.py binds it), `rows` query rows: a sliding-window layer (window 512)
over a view of 640 positions, and a global layer over 1024 to 8192. Each node's median over --runs
calls, the two taking turns.

Target: two sessions of the pair's target in this process, built alike without the runtime cache
(EDGE_SD_RUNTIME_CACHE=0), one with the kernel (EDGE_SD_ATTENTION=1) and one without (=0). Per depth
and repeat, each caches the news articles' first `depth` positions (prefill timed), then the two
step --tokens positions taking turns forward by forward (each fed the argmax of its own step before),
then take turns at three forwards of 17 positions (as a verification forward, cut back after). Rates
are medians over --repeats, the 17-position forward's time over all of them. Their greedy steps are compared
too: the kernel sums in another order than ONNX Runtime's node, and the int8 activations of the
target's products carry that into its logits, so near-ties may go either way.

`--against first-form`: the target only, the kernel over its graph as it runs now against the kernel
over the graph as it first took it (commit 6127445: every attention node also over the previous row,
the global layers' attention a grouped product beside the kernel's node, forwards split at 64).

Writes benchmarks/results/cached_attention.{md,json,png} (cached_attention_graph.* with
`--against first-form`); `--report` writes table and plot again.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from edge_sd.bench.run import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
HEADS, DIM, WINDOW = 4, 256, 512
LAYERS = {"window 512, 640 positions": (WINDOW, 640), "global, 1024": (-1, 1024), "global, 4096": (-1, 4096),
          "global, 8192": (-1, 8192)}
ROWS = (1, 2, 5, 17, 256)
FIRST_FORM = "first-form"


def layer_session(kernel: bool, window: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from edge_sd.engines import attention

    t, f = helper.make_tensor_value_info, TensorProto.FLOAT
    ins = [t("q", f, [1, "s", HEADS * DIM]), t("k", f, [1, "s", DIM]), t("v", f, [1, "s", DIM]),
           t("past_k", f, [1, 1, "n", DIM]), t("past_v", f, [1, 1, "n", DIM]),
           t("seqlens_k", TensorProto.INT32, [1]), t("total", TensorProto.INT32, [])]
    outs = [t(n, f, None) for n in ("out", "present_k", "present_v")]
    domain = attention.DOMAIN if kernel else "com.microsoft"
    node = helper.make_node(attention.OP if kernel else "GroupQueryAttention", [i.name for i in ins],
                            [o.name for o in outs], domain=domain, num_heads=HEADS, kv_num_heads=1,
                            local_window_size=window, scale=DIM ** -0.5)
    model = helper.make_model(helper.make_graph([node], "attention", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if kernel:
        opts.register_custom_ops_library(str(attention.library()[0]))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def layer_times(threads: int, runs: int) -> dict[str, dict[str, list[float]]]:
    """Milliseconds per call, per layer and row count: [ONNX Runtime's, the kernel's]."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    out: dict[str, dict[str, list[float]]] = {}
    for name, (window, positions) in LAYERS.items():
        sessions = [layer_session(k, window, threads) for k in (False, True)]
        out[name] = {}
        for rows in ROWS:
            bindings = []
            for s in sessions:
                io = s.io_binding()
                for x, width in (("q", HEADS * DIM), ("k", DIM), ("v", DIM)):
                    io.bind_cpu_input(x, rng.standard_normal((1, rows, width), np.float32))
                for past, present in (("past_k", "present_k"), ("past_v", "present_v")):
                    buffer = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, 1, positions, DIM), np.float32))
                    io.bind_ortvalue_input(past, buffer)
                    io.bind_ortvalue_output(present, buffer)
                io.bind_cpu_input("seqlens_k", np.array([positions - 1], np.int32))
                io.bind_cpu_input("total", np.array(positions, np.int32))
                io.bind_output("out")
                s.run_with_iobinding(io)  # warm
                bindings.append(io)
            times: list[list[float]] = [[], []]
            for _ in range(runs if rows < 100 else max(3, runs // 10)):
                for i, (s, io) in enumerate(zip(sessions, bindings, strict=True)):
                    start = time.perf_counter()
                    s.run_with_iobinding(io)
                    times[i].append((time.perf_counter() - start) * 1e3)
            out[name][str(rows)] = [statistics.median(x) for x in times]
            print(f"{name}, {rows} rows: ONNX Runtime {out[name][str(rows)][0]:.3f} ms, "
                  f"kernel {out[name][str(rows)][1]:.3f} ms", file=sys.stderr, flush=True)
    return out


def target_runs(pair: Path, depths: list[int], tokens: int, repeats: int, threads: int, against: str) -> dict:
    """Per depth, per engine (ONNX Runtime's attention or the kernel's first graph, the kernel): step
    rate, prefill rate, a 17-position forward's milliseconds (medians), and how many greedy steps
    chose alike."""
    import context_depth as cd

    from edge_sd.engines import attention
    from edge_sd.manifest import load_pair_manifest
    from edge_sd.model import Model

    os.environ["EDGE_SD_RUNTIME_CACHE"] = "0"
    folder = pair / load_pair_manifest(pair).target
    engines = []
    simplified = attention._simplified
    for flag in ("1" if against == FIRST_FORM else "0", "1"):
        os.environ["EDGE_SD_ATTENTION"] = flag
        if against == FIRST_FORM and not engines:  # the graph as the kernel first took it (6127445)
            attention._simplified = lambda graph: ([raw for *_, raw in graph], False)
        target = Model.load(folder, threads=threads).target
        target.session.load()
        attention._simplified = simplified
        engine = target.session.engine(release_window=True)
        engine.reserve(max(depths) + tokens + 20)
        engines.append(engine)
    ids = cd.article_ids(target, max(depths) + tokens + 20)
    out: dict = {}
    for d in depths:
        rec = {k: [[], []] for k in ("steps", "prefill", "verify")}
        same = total = 0
        for _ in range(repeats):
            for i, engine in enumerate(engines):
                rec["prefill"][i].append(d / cd.prefill(engine, ids[:d]) if d else 0.0)
                if not d:
                    engine.reset()
            # One forward each in turn: the machine's speed drifts within seconds.
            toks, spent, chosen = [ids[d], ids[d]], [0.0, 0.0], [[], []]
            for _ in range(tokens):
                for i, engine in enumerate(engines):
                    start = time.perf_counter()
                    toks[i] = int(np.argmax(engine.forward(np.asarray([toks[i]]), scratch=True)[0]))
                    spent[i] += time.perf_counter() - start
                    chosen[i].append(toks[i])
            for i in range(2):
                rec["steps"][i].append(tokens / spent[i])
            for _ in range(3):
                for i, engine in enumerate(engines):
                    at = engine.n_cached
                    start = time.perf_counter()
                    engine.forward(np.asarray(ids[d:d + 17]), scratch=True)
                    rec["verify"][i].append((time.perf_counter() - start) * 1e3)
                    engine.truncate(at)
            first_apart = next((j for j, (a, b) in enumerate(zip(*chosen, strict=True)) if a != b), tokens)
            same, total = same + first_apart, total + tokens
        out[str(d)] = {k: [statistics.median(x) for x in v] for k, v in rec.items()} | {"same": [same, total]}
        v = out[str(d)]
        print(f"depth {d}: {v['steps'][0]:.1f} / {v['steps'][1]:.1f} tok/s, verify {v['verify'][0]:.1f} / "
              f"{v['verify'][1]:.1f} ms, greedy alike {same}/{total}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--depths", default="0,1024,2048,4096,8192")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", choices=["node", FIRST_FORM], default="node",
                    help="the target compared with ONNX Runtime's node, or with the kernel over the graph as it "
                         "first took it (the previous row and the grouped product kept, forwards split at 64): "
                         "then only the target runs, into cached_attention_graph.*")
    ap.add_argument("--report", action="store_true", help="only write the table and plot again from the JSON")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    name = "cached_attention_graph" if args.against == FIRST_FORM else "cached_attention"
    if args.report:
        print(write_results(args.out, name, report, plot))
        return
    from edge_sd.engines import attention

    if attention.library()[0] is None:
        sys.exit(f"the attention kernel did not build: {attention.library()[1]}")
    layers = layer_times(args.threads, args.runs) if args.against == "node" else {}
    target = target_runs(args.pair, [int(d) for d in args.depths.split(",")], args.tokens, args.repeats, args.threads,
                         args.against)
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "options": {k: str(v) for k, v in vars(args).items()}, "layers": layers, "target": target}
    print(write_results(args.out, name, report, plot, result))


def _labels(result: dict) -> tuple[str, str]:
    """The two engines compared: the other one, and the kernel as it runs now."""
    if result["options"].get("against") == FIRST_FORM:
        return "the kernel's first graph", "the kernel's graph now"
    return "ONNX Runtime", "kernel"


def report(result: dict) -> str:
    m, o = result["machine"], result["options"]
    first, now = _labels(result)
    against = o.get("against", "node")
    lines = [
        "# Cached attention: edge-sd's kernel against ONNX Runtime's GroupQueryAttention"
        if against == "node" else "# The kernel's graph now against the graph as the kernel first took it", "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}, {o['threads']} threads "
        f"(`benchmarks/cached_attention.py --against {against}`).", ""]
    if result["layers"]:
        lines += ["One layer (4 query heads over one key/value head of 256, fp32, a shared buffer), milliseconds "
                  "a call, median of interleaved calls:", "",
                  "| layer | rows | ONNX Runtime | kernel | ONNX Runtime / kernel |", "|---|---|---|---|---|"]
        for name, by_rows in result["layers"].items():
            for rows, (a, b) in by_rows.items():
                lines.append(f"| {name} | {rows} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
        lines.append("")
    lines += [f"The pair's target (`{Path(result['pair']).name}`), two sessions in one process taking turns, "
              f"{o['tokens']} greedy steps after each depth, medians of {o['repeats']} repeats:", "",
              f"| cached positions | steps, tok/s: {first} / {now} | ratio | 17-position forward, ms | "
              "prefill, positions/s | greedy steps alike |", "|---|---|---|---|---|---|"]
    for d, v in result["target"].items():
        (a, b), (va, vb), (pa, pb) = v["steps"], v["verify"], v["prefill"]
        fill = f"{pa:.0f} / {pb:.0f}" if int(d) else "-"
        lines.append(f"| {d} | {a:.1f} / {b:.1f} | {b / a:.2f}x | {va:.1f} / {vb:.1f} | {fill} | "
                     f"{v['same'][0]} of {v['same'][1]} |")
    lines += ["", "Greedy steps alike: the steps before the two engines' first different choice, summed over "
              "the repeats. The kernel sums in another order than ONNX Runtime's node (and than the grouped "
              "product of the kernel's first graph, in its global layers); the target's int8 "
              "activations carry such differences into its logits (a few hundredths of their scale), where "
              "a near-tie can go either way. Each engine is exact against itself (a verification forward "
              "computes what its steps compute: tests/test_attention.py, tests/test_gguf.py)."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [int(d) for d in result["target"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ("ONNX Runtime's GroupQueryAttention", "edge-sd's kernel") if result["layers"] else _labels(result)
    for i, label in enumerate(labels):
        ax.plot(depths, [v["steps"][i] for v in result["target"].values()], "o-", label=label)
    ax.set_xlabel("cached positions")
    ax.set_ylabel("greedy steps, tok/s")
    ax.set_title("Gemma-3-270M target, 2 threads")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
