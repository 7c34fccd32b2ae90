"""Could the target's LM head run at 4 bits and stay exact? What its share of a step is, and how far a
4-bit copy's logits can be from the 8-bit head's by a bound that holds for every input.

    .venv/bin/python benchmarks/head_bound.py [--pair PAIR] [--prompts 6] [--positions 500]

Greedy decoding and top-k sampling read only the top of a logits row. A head half the bytes (4-bit
blocks of the same 32 values) would find it, exactly, if each 4-bit logit came with a bound e_i on
its distance from the 8-bit one: every token whose 4-bit logit plus e_i stays below the k-th largest
4-bit logit minus its bound cannot be in the top k, and the rest would be scored again at 8 bits.
Cauchy-Schwarz gives such a bound from the hidden state x (the final norm's output) and each row's
requantization error d_i: |x . d_i| <= |x| |d_i|, plus the error of rounding x to int8 per block as
ONNX Runtime does, |x - x8| |w_i|. This measures, on hidden states of the real target (from
transformers reading the GGUF file, fp32), how many tokens that leaves to score again, beside the
head's share of a one-position step (ONNX Runtime's profiler, the pair's own engine).

Needs the export extras (torch, transformers, gguf). Writes benchmarks/results/head_bound.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

from edge_sd.bench.run import machine, write_results
from edge_sd.tools import prompt_sets
from edge_sd.tools.paths import cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_share import kernel_ms  # noqa: E402  (the profile's kernel and head time per run)

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32  # the head's blocks, and ONNX Runtime's int8 activation blocks at accuracy level 4
TOPS = (1, 40)


def head_share(target: Path, steps: int, prefix: str) -> dict:
    """Median ms of all kernels and of the LM head's in one-position steps of the target engine, 200
    positions cached, 2 threads, logits into the engine's reused buffer as the decoding loop has them."""
    import edge_sd.engines.session as session_module
    from edge_sd.engines.engine import OrtEngine

    plain = session_module.session_options

    def profiled(threads, spin):
        opts = plain(threads, spin)
        opts.enable_profiling, opts.profile_file_prefix = True, prefix
        return opts

    with mock.patch.object(session_module, "session_options", profiled):
        source = session_module.OrtSession(target, provider="cpu", threads=2)
    engine = OrtEngine(source)
    engine.forward(np.arange(1000, 1200, dtype=np.int64))
    wall = []
    for i in range(steps + 10):
        start = time.perf_counter()
        engine.forward(np.array([7 + i], np.int64), scratch=True)
        wall.append(1e3 * (time.perf_counter() - start))
    profile = Path(source.session.end_profiling())
    kernels, head = kernel_ms(profile, steps)
    profile.unlink()
    return {"step_ms": statistics.median(wall[10:]), "kernels_ms": kernels, "head_ms": head}


def hidden_states(gguf: Path, texts: list[str], tokenizer: Path, bos: int,
                  per_text: int) -> tuple[np.ndarray, np.ndarray]:
    """The final norm's output at up to `per_text` positions of each text, and the head's weight (fp32)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                                 dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(tokenizer))
    xs = []
    with torch.no_grad():
        for text in texts:
            ids = [bos] + tok.encode(text, add_special_tokens=False).ids[:400]
            x = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
            xs.append(x[:: max(1, len(x) // per_text)][:per_text])
    return np.concatenate(xs).astype(np.float64), model.get_output_embeddings().weight.detach().numpy()


def requantized(w: np.ndarray, symmetric: bool) -> np.ndarray:
    """w rounded to 4-bit blocks of BLOCK values: q in -8..7 times amax/7, or 0..15 from the minimum."""
    b = w.reshape(len(w), -1, BLOCK).astype(np.float64)
    if symmetric:
        s = np.abs(b).max(-1, keepdims=True) / 7
        s[s == 0] = 1
        return (np.clip(np.round(b / s), -8, 7) * s).reshape(w.shape)
    lo, hi = b.min(-1, keepdims=True), b.max(-1, keepdims=True)
    s = (hi - lo) / 15
    s[s == 0] = 1
    z = np.round(-lo / s)
    return ((np.clip(np.round(b / s) + z, 0, 15) - z) * s).reshape(w.shape)


def bound_rows(x: np.ndarray, w: np.ndarray, symmetric: bool) -> dict:
    """Per position: the bound's size, the true distance, and how many tokens the bound leaves to score
    again for the top 1 and the top 40."""
    w4 = requantized(w, symmetric)
    d_norm = np.linalg.norm(w - w4, axis=1)
    w_norm = np.linalg.norm(w.astype(np.float64), axis=1)
    xb = x.reshape(len(x), -1, BLOCK)
    sx = np.abs(xb).max(-1, keepdims=True) / 127
    x8 = (np.round(xb / sx) * sx).reshape(x.shape)
    rounding = np.sqrt((BLOCK * (sx[..., 0] / 2) ** 2).sum(-1))  # the largest |x - x8| int8 rounding allows
    exact = (x.astype(np.float32) @ w.T).astype(np.float64)
    approx = (x8.astype(np.float32) @ w4.astype(np.float32).T).astype(np.float64)
    eps = (np.linalg.norm(x, axis=1) + rounding)[:, None] * d_norm[None, :] + rounding[:, None] * w_norm[None, :]
    distance = np.abs(exact - approx)
    top = -np.sort(-exact, axis=1)[:, :2]
    out = {"eps_median": float(np.median(eps)), "distance_median": float(np.median(distance)),
           "distance_max": float(distance.max()), "violations": int((distance > eps).sum()),
           "x_norm_median": float(np.median(np.linalg.norm(x, axis=1))),
           # what is left of it without its 16 strongest dimensions (a bound split by dimensions gains little)
           "x_norm_rest16": float(np.median(np.linalg.norm(
               np.delete(x, np.argsort(-(x**2).mean(0))[:16], axis=1), axis=1))),
           "gap_median": float(np.median(top[:, 0] - top[:, 1])), "vocab": len(w)}
    for k in TOPS:
        floor = -np.partition(-(approx - eps), k - 1, axis=1)[:, k - 1]
        left = (approx + eps >= floor[:, None]).sum(1)
        out[f"top{k}"] = {"median": float(np.median(left)), "p10": float(np.percentile(left, 10)),
                          "p90": float(np.percentile(left, 90))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, default=ROOT / "engines" / "gemma3-270m_smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6, help="prompts of each set")
    ap.add_argument("--positions", type=int, default=500, help="hidden states scored, spread over the prompts")
    ap.add_argument("--steps", type=int, default=100, help="profiled target steps")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.report:
        print(write_results(args.out, "head_bound", report, plot))
        return
    from edge_sd.manifest import load_engine_manifest, load_pair_manifest

    target = args.pair / load_pair_manifest(args.pair).target
    m = load_engine_manifest(target)
    gguf = Path(m.source)
    if gguf.suffix != ".gguf" or not gguf.is_file():
        sys.exit(f"{target}: exported from {m.source}, not a GGUF file here")
    profiles = cache_dir() / "profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    share = head_share(target, args.steps, str(profiles / "head_bound"))
    print(f"step {share['step_ms']:.2f} ms, kernels {share['kernels_ms']:.2f}, head {share['head_ms']:.2f}",
          file=sys.stderr, flush=True)
    texts = [p.text for s in prompt_sets.SETS for p in prompt_sets.load(s, cache_dir(), args.prompts)]
    x, w = hidden_states(gguf, texts, target / m.tokenizer_file, m.bos_token_id, -(-args.positions // len(texts)))
    x = x[: args.positions]
    result = {"date": datetime.date.today().isoformat(), "machine": machine(), "pair": str(args.pair),
              "positions": len(x), "prompts": len(texts), "share": share,
              "bounds": {name: bound_rows(x, w, sym) for name, sym in (("symmetric", True), ("with minimum", False))}}
    print(write_results(args.out, "head_bound", report, plot, result))


def report(result: dict) -> str:
    m, s = result["machine"], result["share"]
    lines = ["# A 4-bit LM head with an exact bound: not worth it", "",
             f"{result['date']}, {m['cpu']} ({m['cores']} cores), ONNX Runtime {m['onnxruntime']}; the pair "
             f"`{Path(result['pair']).name}`. Command: `.venv/bin/python benchmarks/head_bound.py --pair PAIR`.", "",
             f"The target's one-position step (200 cached, 2 threads, profiler on): {s['step_ms']:.2f} ms, of "
             f"which kernels {s['kernels_ms']:.2f} ms and the 8-bit LM head {s['head_ms']:.2f} ms "
             f"({100 * s['head_ms'] / s['kernels_ms']:.0f}% of the kernels).", "",
             f"{result['positions']} hidden states of {result['prompts']} code and summarisation prompts; the head "
             "requantized to 4-bit blocks of 32; distance = |logit from the file's 8-bit weights and fp32 "
             "activations - 4-bit logit from int8 activations|, bound = Cauchy-Schwarz "
             "with int8 activation rounding (never exceeded: violations 0 is its check). Tokens left = how many "
             "of the vocabulary the bound cannot rule out of the top k, to be scored again at 8 bits.", "",
             "| 4-bit blocks | bound, median | distance, median / max | violations | tokens left, top 1: "
             "median (p10-p90) | top 40 |", "|---|---|---|---|---|---|"]
    for name, b in result["bounds"].items():
        t1, t40 = b["top1"], b["top40"]
        lines.append(f"| {name} | {b['eps_median']:.2f} | {b['distance_median']:.3f} / {b['distance_max']:.2f} | "
                     f"{b['violations']} | {t1['median']:.0f} ({t1['p10']:.0f}-{t1['p90']:.0f}) | "
                     f"{t40['median']:.0f} ({t40['p10']:.0f}-{t40['p90']:.0f}) |")
    b = next(iter(result["bounds"].values()))
    lines += ["", f"Of a vocabulary of {b['vocab']}. The hidden state's norm is about {b['x_norm_median']:.0f} "
              f"(median), {b['x_norm_rest16']:.0f} without its 16 strongest dimensions: spread over them, so the "
              "bound is tens of times the true distance, while "
              f"the top two logits lie a median {b['gap_median']:.2f} apart: most of the vocabulary would be "
              "scored again. The head stays whole at 8 bits."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["share"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.bar(["target step"], [s["kernels_ms"] - s["head_ms"]], label="layers and the rest")
    left.bar(["target step"], [s["head_ms"]], bottom=[s["kernels_ms"] - s["head_ms"]], label="LM head (8-bit)")
    left.set_ylabel("kernel ms per one-position step")
    left.legend()
    names = list(result["bounds"])
    for j, k in enumerate(TOPS):
        right.bar([i + 0.4 * j for i in range(len(names))],
                  [result["bounds"][n][f"top{k}"]["median"] / result["bounds"][n]["vocab"] for n in names], 0.4,
                  label=f"top {k}")
    right.set_xticks([i + 0.2 for i in range(len(names))], [f"4-bit, {n}" for n in names])
    right.set_ylabel("vocabulary left to score again (median)")
    right.set_ylim(0, 1)
    right.legend()
    fig.suptitle(f"{Path(result['pair']).name}, {result['machine']['cores']} cores, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
