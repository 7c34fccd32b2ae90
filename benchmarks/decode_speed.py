"""Decode speed of the ONNX Runtime engine against transformers' own `generate`, side by side.

Both decode the same model greedily from the same prompts in this one process, with the same thread
count, alternating prompt by prompt so that machine noise hits both alike. Reported: median ms per
decoded token (prefill excluded) and the ratio.

    python benchmarks/decode_speed.py ENGINE_DIR HF_SOURCE [--gguf FILE] [--tokens 64] [--threads 2]

ENGINE_DIR is an exported engine folder (for a pair: its target/ sub-folder); HF_SOURCE what it was
exported from (a folder, or the folder holding the GGUF given with --gguf). Writes
benchmarks/results/decode_speed.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The capital of France is",
    "Summarize: The meeting covered the budget, hiring and the new office.",
]
RESULTS = Path(__file__).parent / "results"


def ort_decode(engine, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    engine.reset()
    engine.forward(np.asarray(prompt_ids[:-1]))
    last, ids, times = prompt_ids[-1], [], []
    for _ in range(n):
        t = time.perf_counter()
        row = engine.forward(np.asarray([last]))[0]
        times.append(time.perf_counter() - t)
        last = int(np.argmax(row))
        ids.append(last)
    return ids, times


def hf_decode(model, prompt_ids: list[int], n: int) -> tuple[list[int], float]:
    """Seconds per decoded token of `generate`: (time for n+1 tokens - time for 1) / n."""
    import torch

    ids = torch.tensor([prompt_ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        one = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n + 1, min_new_tokens=n + 1, **kw)
        full = time.perf_counter() - t
    return out[0, len(prompt_ids):].tolist(), (full - one) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("hf_source")
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from edge_sd.engines.ort import OrtEngine
    from edge_sd.vocab import Vocab

    torch.set_num_threads(args.threads)
    engine = OrtEngine(args.engine_dir, provider="cpu", threads=args.threads)
    m = engine.manifest
    vocab = Vocab.from_file(args.engine_dir / m.tokenizer_file, m.eos_token_ids)
    kw = {"gguf_file": args.gguf} if args.gguf else {}
    model = AutoModelForCausalLM.from_pretrained(args.hf_source, dtype=torch.float32, **kw).eval()
    ort_ms, hf_ms, same = [], [], 0
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            ids = ([m.bos_token_id] if m.add_bos else []) + vocab.encode_text(prompt)
            ours, times = ort_decode(engine, ids, args.tokens)
            theirs, per_token = hf_decode(model, ids, args.tokens)
            ort_ms.append(statistics.median(times) * 1e3)
            hf_ms.append(per_token * 1e3)
            same += ours[: args.tokens] == theirs[: args.tokens]
    result = {
        "model": m.name,
        "threads": args.threads,
        "tokens": args.tokens,
        "runs": len(ort_ms),
        "ort_ms_per_token_median": statistics.median(ort_ms),
        "transformers_ms_per_token_median": statistics.median(hf_ms),
        "speedup": statistics.median(hf_ms) / statistics.median(ort_ms),
        "identical_greedy_outputs": f"{same}/{len(ort_ms)}",
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "decode_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    table = (
        "| model | threads | ONNX Runtime engine, ms/token | transformers generate, ms/token | ratio | "
        "same greedy tokens |\n|---|---|---|---|---|---|\n"
        f"| {m.name} | {args.threads} | {result['ort_ms_per_token_median']:.1f} | "
        f"{result['transformers_ms_per_token_median']:.1f} | {result['speedup']:.2f}x | "
        f"{result['identical_greedy_outputs']} |\n"
    )
    (RESULTS / "decode_speed.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
