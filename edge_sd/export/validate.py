"""Check an exported engine against torch and against itself (run as a subprocess by the exporter).

    python -m edge_sd.export.validate ENGINE_DIR HF_SOURCE [--precision fp32] [--drafter] [--provider cuda]

Prints one JSON line of figures; exits 1 (with an "error" key) when a check fails.

What speculative decoding needs of a target: a verification forward over several positions computes
what single steps compute (engines/consistency.py). Figures against a forward over the whole sequence:
single-position steps (which some CPU kernels run through another code path) and forwards over two or
more positions (two-position steps that re-feed the last cached token, and a four-position forward
after the cache was cut back). When single steps differ beyond the tolerance and those longer forwards
agree exactly with each other, the engine is marked to feed at least two positions per forward
(`min_step_positions`). --provider cuda validates a graph made for CUDA on the GPU it runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

# fp32 ONNX vs torch: both run the same float32 graph, differences come from kernel order only.
TORCH_RTOL_FP32 = 1e-3
# gguf: the same weights as torch's (the file dequantized), but MatMulNBits quantizes activations to
# int8 per block of 32; compounded over the layers, that moves logits by 5-15% of their scale on most
# random-token positions, and by most of it at a position whose activations have an outlier channel
# (it flattens the rest of its block). So the figure is recorded, and what is checked is the argmax:
# a wrong weight leaves next to no agreement with torch, int8 activations most of it.
TOP1_FLOOR_GGUF = 0.5


def validate(engine_dir: Path, hf_src: str, precision: str, drafter: bool = False, provider: str = "cpu") -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from edge_sd.engines import consistency as cons
    from edge_sd.engines.ort import OrtEngine

    # The figures are the exported graph's, with ONNX Runtime's own attention nodes: edge-sd's kernel,
    # which a CPU load may put in their place (engines/attention.py), computes each row alike in any
    # forward and in any view on a multiple of 16 positions, so what holds here holds for it too,
    # while what holds for the kernel need not hold where a host runs the graph as it is.
    os.environ["EDGE_SD_ATTENTION"] = "0"
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(hf_src, dtype=torch.float32).eval()
    engine = OrtEngine(engine_dir, provider=provider, threads=2, min_step_positions=1)
    rng = np.random.default_rng(0)
    vocab = engine.manifest.scored_ids
    worst = {"torch": 0.0, "single": 0.0, "multi": 0.0, "small": 0.0, "head": 0.0}
    top1_agree = []
    for _ in range(cons.N_PROMPTS):
        ids = rng.integers(0, vocab, size=cons.PROMPT_LEN + cons.STEPS)
        with torch.no_grad():
            ref = model(torch.tensor(ids[None])).logits[0].numpy()  # [T+4, V]
        engine.min_step = 1
        engine.reset()
        full = engine.forward(ids)  # [T+4, V]: the reference for the engine against itself
        worst["torch"] = max(worst["torch"], cons.rel(full, ref, max(1.0, float(np.abs(ref).max()))))
        top1_agree.append(float(np.mean(full.argmax(-1) == ref.argmax(-1))))
        cons.measure(engine, ids, full, worst)
    # Two-position steps are the price of batch consistency where single steps take other kernels
    # (one-row attention and 4-bit MatMulNBits, rounded further by int8 activations). They cost time,
    # so they are chosen only where single steps are off by more than the tolerance and longer
    # forwards are exact (fp32 single steps differ by ~1e-6 of the logit scale: near-ties only, as
    # plain decoding against any other kernel order).
    min_step = cons.min_step_for(worst, engine.manifest.kv_layout)
    split = cons.measure_split(engine, min_step, worst, rng, vocab)  # forwards as steps meet a split
    consistency = worst["small"] if min_step == 2 else max(worst["single"], worst["multi"],
                                                           worst["small"] if split else 0.0)
    result = {
        "precision": precision,
        "provider": provider,
        "prompts": cons.N_PROMPTS,
        "prompt_len": cons.PROMPT_LEN,
        "max_rel_diff_vs_torch": worst["torch"],
        "top1_agreement_vs_torch": float(np.mean(top1_agree)),
        "max_rel_diff_single_position": worst["single"],
        "max_rel_diff_multi_position": worst["multi"],
        "min_step_positions": min_step,
        "max_rel_diff_head_one_row": worst["head"],
        "min_head_rows": cons.min_head_rows_for(worst, min_step),
        "max_rel_diff_steps_vs_forward": consistency,
        # Sliding-window layers over views of their cache (manifest window_views): the offsets' step
        # at which they compute what the whole cache does, bit for bit (0: views off).
        "window_granule": cons.window_granule(engine, rng, vocab) if not drafter and provider == "cpu" else 0,
        "tolerance_vs_torch": TORCH_RTOL_FP32 if precision == "fp32" else None,
        "top1_floor_vs_torch": TOP1_FLOOR_GGUF if precision == "gguf" and not drafter else None,
        "tolerance_cache": cons.CACHE_RTOL,
        # A drafter's forwards need not agree with each other (the verifier uses exactly what it
        # proposed), so a drafter is not held to the cache tolerance; nor is a GPU graph, whose fp16
        # kernels round with the forward's shape beyond any setting (int4 Gemma-3-270M on an H200:
        # 3e-3): recorded there, and speculative output equals plain decoding up to those near-ties.
        "cache_checks_required": not drafter and provider == "cpu",
    }
    failures = []
    bound, floor = result["tolerance_vs_torch"], result["top1_floor_vs_torch"]
    if bound is not None and worst["torch"] > bound:
        failures.append(f"logits differ from torch by {worst['torch']:.2e} (relative) > {bound}")
    if floor is not None and result["top1_agreement_vs_torch"] < floor:
        failures.append(f"the argmax agrees with torch on {result['top1_agreement_vs_torch']:.0%} of positions, "
                        f"below {floor:.0%}: the graph does not compute what the file holds")
    if consistency > cons.CACHE_RTOL and result["cache_checks_required"]:
        failures.append(f"a multi-position forward differs from single steps by {consistency:.2e} > {cons.CACHE_RTOL}")
    if failures:
        result["error"] = "; ".join(failures)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("hf_source")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--provider", default="cpu", help="where the engine runs: cpu or cuda (a graph made for CUDA)")
    ap.add_argument("--drafter", action="store_true", help="the engine is a drafter (see cache_checks_required)")
    args = ap.parse_args(argv)
    try:
        result = validate(args.engine_dir, args.hf_source, args.precision, args.drafter, args.provider)
    except Exception as e:  # report any crash as a failed validation, in the same JSON shape
        result = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
