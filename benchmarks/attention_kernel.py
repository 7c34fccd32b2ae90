"""One global attention layer's cost against context depth: ONNX Runtime's GroupQueryAttention as the
exported targets run it, beside a grouped form that reads each cached key and value once.

    .venv/bin/python benchmarks/attention_kernel.py [--depths 1024,2048,4096,8192] [--heads 4]

The shapes are Gemma-3-270M's global layers (4 query heads over 1 key/value head of 256) and a step of
two query rows (a position and the previous one, as the target's steps feed the attention). Per depth,
one after the other in this process, each a median of --runs calls:

- `gqa fp32`: GroupQueryAttention over a shared [1, 1, capacity, 256] fp32 cache bound as past and
  present (as engines/kv.py binds it);
- `gqa fp16`: the same in fp16 (the layout llama.cpp keeps its cache in);
- `grouped fp32`: the 4 heads' query rows stacked into one [heads x rows, 256] matrix against the
  cache's first `depth` positions: Gemm (keys transposed), Softmax, MatMul (values): the form a
  `gguf` target's global layers of one key/value head compute (export/grouped_attention.py), here
  without its mask.

Writes benchmarks/results/attention_kernel.{md,json,png}; `--report` writes the table and plot again.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import numpy as np

from edge_sd.bench.run import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
DIM = 256
KINDS = ("gqa fp32", "gqa fp16", "grouped fp32")


def gqa_graph(heads: int, fp16: bool, capacity: int) -> bytes:
    from onnx import TensorProto, helper

    dt = TensorProto.FLOAT16 if fp16 else TensorProto.FLOAT
    t = helper.make_tensor_value_info
    ins = [t("q", dt, [1, "s", heads * DIM]), t("k", dt, [1, "s", DIM]), t("v", dt, [1, "s", DIM]),
           t("past_k", dt, [1, 1, capacity, DIM]), t("past_v", dt, [1, 1, capacity, DIM]),
           t("seqlens_k", TensorProto.INT32, [1]), t("total", TensorProto.INT32, [])]
    outs = [t(n, dt, None) for n in ("out", "present_k", "present_v")]
    node = helper.make_node("GroupQueryAttention", [i.name for i in ins], [o.name for o in outs],
                            domain="com.microsoft", num_heads=heads, kv_num_heads=1, scale=DIM ** -0.5)
    graph = helper.make_graph([node], "gqa", ins, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def grouped_graph(masked: bool = False) -> bytes:
    from onnx import TensorProto, helper

    t = helper.make_tensor_value_info
    ins = [t("q", TensorProto.FLOAT, ["rows", DIM]), t("k", TensorProto.FLOAT, ["n", DIM]),
           t("v", TensorProto.FLOAT, ["n", DIM])] + [t("mask", TensorProto.FLOAT, ["rows", "n"])] * masked
    nodes = [helper.make_node("Gemm", [i.name for i in ins if i.name != "v"], ["scores"], transB=1,
                              alpha=DIM ** -0.5),
             helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["out"])]
    graph = helper.make_graph(nodes, "grouped", ins, [t("out", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def timed(session, io, runs: int) -> float:
    for _ in range(5):
        session.run_with_iobinding(io)
    spent = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run_with_iobinding(io)
        spent.append(time.perf_counter() - start)
    return statistics.median(spent)


def measure(depths: list[int], heads: int, rows: int, threads: int, runs: int) -> dict[str, dict[str, float]]:
    import onnxruntime as ort

    capacity = max(depths) + 256
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    rng = np.random.default_rng(0)
    sessions = {kind: ort.InferenceSession(gqa_graph(heads, kind == "gqa fp16", capacity) if kind.startswith("gqa")
                                           else grouped_graph(), opts, providers=["CPUExecutionProvider"])
                for kind in KINDS}
    cache = {dt: [rng.standard_normal((1, 1, capacity, DIM)).astype(dt) for _ in range(2)]
             for dt in (np.float32, np.float16)}
    seconds: dict[str, dict[str, float]] = {str(d): {} for d in depths}
    for depth in depths:
        for kind in KINDS:
            session, io = sessions[kind], sessions[kind].io_binding()
            dt = np.float16 if kind == "gqa fp16" else np.float32
            if kind.startswith("gqa"):
                keys, values = (ort.OrtValue.ortvalue_from_numpy(c) for c in cache[dt])
                io.bind_cpu_input("q", rng.standard_normal((1, rows, heads * DIM)).astype(dt))
                io.bind_cpu_input("k", rng.standard_normal((1, rows, DIM)).astype(dt))
                io.bind_cpu_input("v", rng.standard_normal((1, rows, DIM)).astype(dt))
                io.bind_cpu_input("seqlens_k", np.array([depth + rows - 1], np.int32))
                io.bind_cpu_input("total", np.array(capacity, np.int32))
                for name, value in (("past_k", keys), ("past_v", values)):
                    io.bind_ortvalue_input(name, value)
                    io.bind_ortvalue_output(name.replace("past", "present"), value)
                io.bind_output("out")
            else:
                io.bind_cpu_input("q", rng.standard_normal((heads * rows, DIM)).astype(dt))
                io.bind_cpu_input("k", cache[dt][0][0, 0, :depth])
                io.bind_cpu_input("v", cache[dt][1][0, 0, :depth])
                io.bind_output("out")
            seconds[str(depth)][kind] = timed(session, io, runs)
    return seconds


def grouped_exactness(heads: int, threads: int, positions: range) -> tuple[int, int]:
    """How many of the grouped form's outputs for one position's heads differ at all from those of a
    forward of that position alone, when the position shares the forward with 1, 2 or 6 later ones
    and the keys are bound to its own length, the forward's, the next multiple of 64 or 300 more
    (later positions masked with -inf). Returns (differing, compared)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(grouped_graph(masked=True), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    keys, values = (rng.standard_normal((positions.stop + 400, DIM)).astype(np.float32) for _ in range(2))

    def run(q: np.ndarray, at: list[int], n: int) -> np.ndarray:
        mask = np.where(np.arange(n)[None, :] <= np.array(at)[:, None], 0, -np.inf).astype(np.float32)
        return session.run(None, {"q": q, "k": keys[:n], "v": values[:n], "mask": mask})[0]

    differing = compared = 0
    for p in positions:
        q = rng.standard_normal((heads, DIM)).astype(np.float32)
        alone = run(q, [p] * heads, p + 1)
        for later in (1, 2, 6):
            rows = np.concatenate([q, rng.standard_normal((heads * later, DIM)).astype(np.float32)])
            at = [p] * heads + [p + 1 + i // heads for i in range(heads * later)]
            for n in (p + 1, p + 1 + later, (p + 1) // 64 * 64 + 64, p + 300):
                compared += 1
                differing += not np.array_equal(run(rows, at, n)[:heads], alone)
    return differing, compared


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="1024,2048,4096,8192")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--report", action="store_true", help="only write the table and plot again from the JSON")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "attention_kernel", report, plot))
        return
    depths = [int(d) for d in args.depths.split(",")]
    result = {"date": datetime.date.today().isoformat(), "machine": machine(),
              "options": {k: str(v) for k, v in vars(args).items()},
              "seconds": measure(depths, args.heads, args.rows, args.threads, args.runs),
              "grouped_exactness": grouped_exactness(args.heads, args.threads, range(1000, 1400, 7))}
    print(write_results(args.out, "attention_kernel", report, plot, result))


def report(result: dict) -> str:
    m, o = result["machine"], result["options"]
    lines = [
        "# One global attention layer against context depth",
        "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}, {o['threads']} "
        f"threads; {o['heads']} query heads over one key/value head of {DIM}, {o['rows']} query rows, median "
        f"of {o['runs']} calls (`benchmarks/attention_kernel.py`).",
        "",
        "| cached positions | " + " | ".join(f"{k}, ms" for k in KINDS) + " | gqa fp32 / grouped |",
        "|---|" + "---|" * (len(KINDS) + 1),
    ]
    for depth, by_kind in result["seconds"].items():
        cells = " | ".join(f"{by_kind[k] * 1e3:.2f}" for k in KINDS)
        lines.append(f"| {depth} | {cells} | {by_kind['gqa fp32'] / by_kind['grouped fp32']:.2f}x |")
    if "grouped_exactness" in result:
        differing, compared = result["grouped_exactness"]
        lines += ["", "Grouped form, one position's heads computed alone against the same position in a forward of",
                  f"1, 2 or 6 more positions with the keys bound to 4 lengths (later positions masked): "
                  f"{differing} of {compared} outputs differ at all."]
    lines += [
        "",
        "GroupQueryAttention's CPU kernel scores each query head on its own, so with four heads sharing one",
        "key/value head it reads the cache four times; stacked into one matrix, the heads read it once.",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = [int(d) for d in result["seconds"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind in KINDS:
        ax.plot(depths, [v[kind] * 1e3 for v in result["seconds"].values()], "o-", label=kind)
    ax.set_xlabel("cached positions")
    ax.set_ylabel("one layer's attention, ms (median)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['machine']['cpu']}, {result['options']['threads']} threads, {result['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
