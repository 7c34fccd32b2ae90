"""How far quantized engines' next-token distributions lie from an fp32 run of the same GGUF file, on
real text: edge-sd engines (say the pair's target and an older export of it) and, with --llama-bin,
llama.cpp on the file itself.

    .venv/bin/python benchmarks/fp32_distance.py --fp32 FP32_FOLDER --engine gguf=PAIR_FOLDER \\
        [--engine NAME=FOLDER ...] [--llama-bin DIR --gguf FILE] [--articles 20] [--ctx 256]

FP32_FOLDER: the file exported with `edge-sd export -t FILE.gguf --precision fp32`. The text is the
first news articles, cut into chunks of --ctx tokens as llama-perplexity cuts them (BOS first), each
scored on its second half. Per engine: the mean and largest KL divergence of its distribution from
the fp32 one, how often its argmax is the fp32 argmax, the mean and largest logit difference, and its
perplexity. Writes benchmarks/results/fp32_distance.{md,json,png}. Perplexity alone can hide the
difference: errors in both directions cancel in it, not in the KL divergence.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from llama_cpp import chunks, second_half  # benchmarks/, the script's folder

from edge_sd.bench.run import machine, write_results
from edge_sd.pipeline import Pipeline
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def scored(logits: np.ndarray, ctx: int) -> np.ndarray:
    """The rows of a chunk's logits [ctx, V] that predict its second half, as log-probabilities (float32:
    the compared runs' rows are held together)."""
    return second_half(logits, ctx).astype(np.float32)


def edge_rows(engine, parts: list[list[int]], ctx: int) -> np.ndarray:
    out = []
    for chunk in parts:
        engine.reset()
        engine.reserve(ctx)
        out.append(scored(engine.forward(np.asarray(chunk)), ctx))
    return np.concatenate(out)


def llama_rows(bin_dir: Path, gguf: Path, parts: list[list[int]], ctx: int, threads: int, width: int) -> np.ndarray:
    from gguf_architectures import llama_logits

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exe = llama_logits(bin_dir, work)
        (work / "prompts.txt").write_text("".join(" ".join(map(str, c)) + "\n" for c in parts))
        with open(work / "prompts.txt") as stdin:
            subprocess.run([exe, gguf, str(threads), "0", work / "logits.bin"], stdin=stdin, capture_output=True,
                           check=True)
        raw = np.memmap(work / "logits.bin", dtype=np.float32, mode="r")
        n_vocab = raw.size // (len(parts) * ctx)
        every = raw.reshape(len(parts), ctx, n_vocab)[:, :, :width]
        return np.concatenate([scored(np.asarray(c), ctx) for c in every])


def distance(ref: np.ndarray, got: np.ndarray, targets: np.ndarray) -> dict:
    """ref, got: log-probabilities [positions, V], float32; compared in float64 a slice at a time."""
    kl = np.concatenate([(np.exp(r.astype(np.float64)) * (r.astype(np.float64) - g)).sum(-1)
                         for r, g in zip(np.array_split(ref, 8), np.array_split(got, 8), strict=True)])
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_as_fp32": float((got.argmax(-1) == ref.argmax(-1)).mean()),
            "perplexity": float(np.exp(-got[np.arange(len(got)), targets].astype(np.float64).mean()))}


def report(r: dict) -> str:
    m = r["machine"]
    lines = ["# Distance from the fp32 run of the same GGUF file", "",
             f"{r['date']}; {m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}; {r['file']}; "
             f"the first {r['articles']} news articles in chunks of {r['ctx']} tokens, each scored on its second "
             f"half ({r['positions']} positions). KL: of each engine's next-token distribution from the fp32 "
             "export's; top-1: positions whose argmax is the fp32 one's. llama.cpp: its logits for the same "
             "token ids through libllama (benchmarks/llama_logits.cpp). "
             f"fp32 perplexity {r['fp32_perplexity']:.3f}. Command: `{r['command']}`.", "",
             "| engine | KL mean | KL max | top-1 as fp32 | perplexity |", "|---|---|---|---|---|"]
    for name, d in r["engines"].items():
        lines.append(f"| {name} | {d['kl_mean']:.5f} | {d['kl_max']:.4f} | {100 * d['top1_as_fp32']:.1f}% | "
                     f"{d['perplexity']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["engines"])
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(names, [r["engines"][n]["kl_mean"] for n in names], color="#4477aa")
    ax.set_xlabel("mean KL divergence from the fp32 run (lower is closer)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32", type=Path, required=True, help="an fp32 export of the GGUF file (one engine)")
    ap.add_argument("--engine", action="append", required=True, help="NAME=FOLDER: an edge-sd engine or pair")
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp's binaries (benchmarks/llama_cpp.sh)")
    ap.add_argument("--gguf", type=Path, help="the GGUF file, for llama.cpp")
    ap.add_argument("--articles", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if bool(args.llama_bin) != bool(args.gguf):
        ap.error("--llama-bin and --gguf go together")
    ref_side = Pipeline.from_folder(args.fp32, threads=args.threads).target
    text = "\n".join(prompt_sets.articles(cache_dir(), args.articles))
    parts = chunks(ref_side.vocab.encode_text(text), args.ctx, ref_side.manifest.bos_token_id)
    targets = np.concatenate([c[args.ctx // 2 :] for c in parts])
    ref = edge_rows(ref_side.engine, parts, args.ctx)
    del ref_side  # the fp32 engine's memory back before the others load
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "file": args.gguf.name if args.gguf
              else args.fp32.name, "articles": args.articles, "ctx": args.ctx, "positions": len(ref),
              "fp32_perplexity": float(np.exp(-ref[np.arange(len(ref)), targets].mean())), "engines": {},
              "command": "python benchmarks/fp32_distance.py --fp32 FP32_FOLDER " + " ".join(
                  f"--engine '{e.split('=')[0]}=FOLDER'" for e in args.engine) + (" --llama-bin DIR --gguf FILE"
                                                                                  if args.gguf else "")}
    for spec in args.engine:
        name, _, folder = spec.partition("=")
        engine = Pipeline.from_folder(Path(folder), threads=args.threads).target.engine
        result["engines"][name] = distance(ref, edge_rows(engine, parts, args.ctx), targets)
        print(name, result["engines"][name])
    if args.llama_bin:
        got = llama_rows(args.llama_bin, args.gguf, parts, args.ctx, args.threads, ref.shape[1])
        result["engines"]["llama.cpp"] = distance(ref, got, targets)
        print("llama.cpp", result["engines"]["llama.cpp"])
    print(write_results(args.out, "fp32_distance", report, plot, result))


if __name__ == "__main__":
    main()
