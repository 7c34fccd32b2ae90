"""The target's LM head computed by edge-sd's own kernel against the graph's MatMulNBits head: decode
rates of plain decoding and auto, greedy and in the chat setting, on the real pair.

    .venv/bin/python benchmarks/lm_head.py --pair engines/gemma3-270m_smollm2-135m [--per-set 6]

Two pipelines over the same folder in one process, one loaded with EDGE_SD_LM_HEAD=0 (the graph's
head), one computing the head itself (engines/lm_head.py; the CPU needs AVX-512 VNNI and a C
compiler); every prompt and mode runs on both in turn, the order swapped each time. The prompts are
benchmarks/llama_cpp.py's 18 (code, summaries, prose; 64 new tokens, each with its seed). Reports
median decode rates, the median of per-prompt ratios, and whether each pipeline's greedy auto equals
its own plain decoding (the two heads round apart, so their texts may part at near ties).

Writes benchmarks/results/lm_head.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp  # noqa: E402

from edge_sd.bench.run import machine, write_results  # noqa: E402
from edge_sd.engines import lm_head  # noqa: E402
from edge_sd.pipeline import Pipeline  # noqa: E402

NAMES = ("graph's head", "own head")
RUNS = (("plain", "greedy"), ("auto", "greedy"), ("plain", "chat"), ("auto", "chat"))


def load(pair: Path) -> dict[str, Pipeline]:
    pipes = {}
    for name, switch in zip(NAMES, ("0", "1"), strict=True):
        os.environ[lm_head.ENV] = switch  # read as a session is built
        pipes[name] = Pipeline.from_folder(pair)
    del os.environ[lm_head.ENV]
    if pipes["graph's head"].target.session.head is not None or pipes["own head"].target.session.head is None:
        sys.exit("lm_head: the pair's target has no head the runtime can compute (export it again), or this "
                 "machine cannot build or run the kernel")
    return pipes


def measure(pair: Path, per_set: int) -> dict:
    pipes = load(pair)
    prompts = llama_cpp.prompt_list(list(llama_cpp.SHORT_SETS), per_set, llama_cpp.SKIP)
    for pipe in pipes.values():  # warm-up: the first forwards of each shape
        llama_cpp._edge(pipe, prompts[0][1], 16, "auto", "greedy", 1)
    runs: dict = {f"{a}, {m}": {name: [] for name in NAMES} for a, m in RUNS}
    ids: dict = {name: {a: [] for a in ("plain", "auto")} for name in NAMES}
    turn = 0
    for i, (label, text) in enumerate(prompts):
        print(f"[{i + 1}/{len(prompts)}] {label}", flush=True)
        for algorithm, mode in RUNS:
            order = NAMES[:: 1 if turn % 2 else -1]
            turn += 1
            for name in order:
                r = llama_cpp._edge(pipes[name], text, 64, algorithm, mode, 1000 + i)
                runs[f"{algorithm}, {mode}"][name].append(r["rate"])
                if mode == "greedy":
                    ids[name][algorithm].append(r["ids"])
    equal = {name: sum(a == b for a, b in zip(ids[name]["plain"], ids[name]["auto"], strict=True)) for name in NAMES}
    same = sum(a == b for a, b in zip(ids[NAMES[0]]["plain"], ids[NAMES[1]]["plain"], strict=True))
    return {"date": datetime.date.today().isoformat(), "machine": machine(), "per_set": per_set,
            "labels": [label for label, _ in prompts], "runs": runs, "auto_equal_plain": equal,
            "plain_equal_across": same, "prompts": len(prompts)}


def _by_set(result: dict, values: list[float]) -> dict[str, float]:
    sets: dict[str, list[float]] = {}
    for label, v in zip(result["labels"], values, strict=True):
        sets.setdefault(label, []).append(v)
    return {**{k: statistics.median(v) for k, v in sets.items()}, "all": statistics.median(values)}


def report(result: dict) -> str:
    m = result["machine"]
    sets = list(dict.fromkeys(result["labels"])) + ["all"]
    lines = [
        "# The LM head computed by edge-sd's kernel against the graph's", "",
        f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}; the pair "
        "`gemma3-270m_smollm2-135m`. Command: `.venv/bin/python benchmarks/lm_head.py --pair PAIR "
        f"--per-set {result['per_set']}`. {result['prompts']} prompts, 64 new tokens, 2 threads; both pipelines "
        "in one process, each prompt and mode on both in turn. Decode rate (tok/s), median per set; ratio: the "
        "median of per-prompt ratios.", "",
        "| run | head | " + " | ".join(sets) + " |", "|---|---|" + "---|" * len(sets),
    ]
    for run, rates in result["runs"].items():
        for name in NAMES:
            by = _by_set(result, rates[name])
            lines.append(f"| {run} | {name} | " + " | ".join(f"{by[s]:.1f}" for s in sets) + " |")
        ratio = _by_set(result, [a / b for a, b in zip(rates["own head"], rates["graph's head"], strict=True)])
        lines.append(f"| {run} | own / graph's | " + " | ".join(f"{ratio[s]:.2f}x" for s in sets) + " |")
    n = result["prompts"]
    eq = result["auto_equal_plain"]
    lines += ["", f"Greedy auto equal to the same pipeline's plain decoding: graph's head {eq[NAMES[0]]} of {n}, "
              f"own head {eq[NAMES[1]]} of {n}. Greedy plain texts equal between the two heads: "
              f"{result['plain_equal_across']} of {n}.", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    runs = list(result["runs"])
    width = 0.38
    for j, name in enumerate(NAMES):
        values = [statistics.median(result["runs"][r][name]) for r in runs]
        ax.bar([i + (j - 0.5) * width for i in range(len(runs))], values, width, label=name)
    ax.set_xticks(range(len(runs)), runs)
    ax.set_ylabel("tok/s (median, all prompts)")
    ax.set_title("Target's LM head: the graph's MatMulNBits or edge-sd's kernel")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--per-set", type=int, default=6)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "lm_head", report, plot))
        return
    print(write_results(args.out, "lm_head", report, plot, measure(args.pair, args.per_set)))


if __name__ == "__main__":
    main()
