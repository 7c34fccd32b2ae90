"""Is the target's LM head bound by memory or by its kernel? The head's product alone against what the
machine's cores can stream.

    .venv/bin/python benchmarks/head_kernel.py [--rounds 5] [--threads 1,2]

The default target's tied head is 262,144 x 640 weights, Q8_0 in its GGUF file, which the export
carries as 8-bit MatMulNBits blocks of 32 in four parts along the vocabulary. This times that
product for one row (a decoding step) on random weights, at 8 and 4 bits, ONNX Runtime's int8
activations (accuracy level 4), with 1 and 2 threads, and reads each result as the bytes of its
weights and float32 scales streamed per second. Beside it: how fast one and two processes stream a
400 MiB array (numpy, one thread each, the two started together). Where the product streams well
below that, its kernel and not the memory bounds the head. No model or export extras needed.

Writes benchmarks/results/head_kernel.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import time
from pathlib import Path

import numpy as np

from edge_sd.bench.run import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
VOCAB, HIDDEN, BLOCK, PARTS = 262_144, 640, 32, 4
STREAM_BYTES = 400 << 20


def head_session(bits: int, threads: int, spin: str = "always"):
    """A session of the head's shape: PARTS MatMulNBits nodes over the vocabulary, concatenated, for any
    number of rows (spin as engines/session.py takes it; "run" where other threads work between runs)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from edge_sd.engines.providers import session_options

    rng = np.random.default_rng(0)
    rows = VOCAB // PARTS
    nodes, weights = [], []
    for p in range(PARTS):
        blob = rng.integers(0, 256, size=(rows, HIDDEN // BLOCK, BLOCK * bits // 8), dtype=np.uint8)
        scales = rng.uniform(1e-3, 1e-2, size=rows * HIDDEN // BLOCK).astype(np.float32)
        weights += [numpy_helper.from_array(blob, f"w{p}"), numpy_helper.from_array(scales, f"s{p}")]
        nodes.append(helper.make_node("MatMulNBits", ["x", f"w{p}", f"s{p}"], [f"y{p}"], domain="com.microsoft",
                                      K=HIDDEN, N=rows, bits=bits, block_size=BLOCK, accuracy_level=4))
    nodes.append(helper.make_node("Concat", [f"y{p}" for p in range(PARTS)], ["y"], axis=-1))
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", HIDDEN])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", VOCAB])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    opts = session_options(threads, spin)  # an engine's own options
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def weight_bytes(bits: int) -> int:
    """The weights and their float32 scales, as the node's inputs hold them."""
    return VOCAB * HIDDEN * bits // 8 + VOCAB * HIDDEN // BLOCK * 4


def time_ms(session, runs: int = 50) -> float:
    x = np.random.default_rng(1).standard_normal((1, HIDDEN)).astype(np.float32)
    for _ in range(5):
        session.run(None, {"x": x})
    took = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, {"x": x})
        took.append(time.perf_counter() - start)
    return 1e3 * statistics.median(took)


def _stream(ready, results) -> None:
    data = np.ones(STREAM_BYTES // 8, dtype=np.int64)
    data.sum()
    ready.wait()
    best = min(_timed_sum(data) for _ in range(8))
    results.put(STREAM_BYTES / best / 1e9)


def _timed_sum(data: np.ndarray) -> float:
    start = time.perf_counter()
    data.sum()
    return time.perf_counter() - start


def stream_gbs(processes: int) -> float:
    """GB/s that `processes` one-thread readers stream together, started at one barrier."""
    ctx = multiprocessing.get_context("spawn")
    ready, results = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_stream, args=(ready, results)) for _ in range(processes)]
    for p in procs:
        p.start()
    total = sum(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return total


def report(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# The LM head's product: its kernel against the memory's speed", "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}. "
        f"Command: `.venv/bin/python benchmarks/head_kernel.py --rounds {result['rounds']}`. The head's shape "
        f"({VOCAB:,} x {HIDDEN}, {PARTS} MatMulNBits parts, blocks of {BLOCK}, int8 activations), one row, "
        "random weights; median over rounds of each round's median of 50 runs.", "",
        "| weights | threads | ms | GB/s of weights and scales |", "|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['bits']}-bit | {row['threads']} | {row['ms']:.2f} | {row['gbs']:.1f} |")
    streams = ", ".join(f"{n} process{'es' if int(n) > 1 else ''} {v:.1f} GB/s"
                        for n, v in result["stream_gbs"].items())
    lines += ["", f"Streaming a 400 MiB array (numpy, one thread a process): {streams}.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    labels = [f"{r['bits']}-bit, {r['threads']} thr" for r in result["rows"]]
    ax.bar(labels, [r["gbs"] for r in result["rows"]], color="tab:blue")
    for n, v in result["stream_gbs"].items():
        ax.axhline(v, ls="--", color="tab:gray")
        ax.text(len(labels) - 0.5, v, f"stream, {n} proc", va="bottom", ha="right", fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("LM head product vs memory streaming")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "head_kernel", report, plot))
        return
    threads = [int(t) for t in args.threads.split(",")]
    sessions = {(bits, t): head_session(bits, t) for bits in (8, 4) for t in threads}
    times: dict[tuple[int, int], list[float]] = {k: [] for k in sessions}
    for r in range(args.rounds):
        for key, session in sessions.items():  # interleaved: a slow spell hits every row alike
            times[key].append(time_ms(session))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{b}-bit {t} thr {v[-1]:.2f} ms"
                                                            for (b, t), v in times.items()), flush=True)
    rows = []
    for (bits, t), ms in times.items():
        med = statistics.median(ms)
        rows.append({"bits": bits, "threads": t, "ms": med, "gbs": weight_bytes(bits) / med / 1e6})
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "rounds": args.rounds,
              "rows": rows, "stream_gbs": {str(n): stream_gbs(n) for n in (1, 2)}}
    print(write_results(args.out, "head_kernel", report, plot, result))


if __name__ == "__main__":
    main()
