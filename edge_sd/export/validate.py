"""Check an exported engine against torch and against itself (run as a subprocess by the exporter).

    python -m edge_sd.export.validate ENGINE_DIR HF_SOURCE [--precision fp32] [--drafter]

Prints one JSON line of figures; exits 1 (with an "error" key) when a check fails.

What speculative decoding needs of a target: a verification forward over several positions computes
what single steps compute. Two figures measure it against a forward over the whole sequence:
single-position steps (which some CPU kernels run through another code path) and forwards over two or
more positions (two-position steps that re-feed the last cached token, and a four-position forward
after the cache was cut back). When single steps differ beyond the tolerance and longer forwards are
exact, the engine is marked to feed at least two positions per forward (`min_step_positions`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# fp32 ONNX vs torch: both run the same float32 graph, differences come from kernel order only.
TORCH_RTOL_FP32 = 1e-3
# The engine against itself (cached vs full, multi-token vs single-token): same weights, other shapes.
CACHE_RTOL = 1e-4
PROMPT_LEN = 12
STEPS = 4
N_PROMPTS = 3


def _rel(a: np.ndarray, b: np.ndarray, scale: float) -> float:
    return float(np.abs(a - b).max()) / scale


def _steps(engine, ids: np.ndarray, min_step: int) -> np.ndarray:
    """Logits of positions PROMPT_LEN .. PROMPT_LEN+STEPS-1 fed one step at a time after a prefill."""
    engine.min_step = min_step
    engine.reset()
    engine.forward(ids[:PROMPT_LEN])
    return np.stack([engine.forward(ids[j : j + 1])[0] for j in range(PROMPT_LEN, PROMPT_LEN + STEPS)])


def validate(engine_dir: Path, hf_src: str, precision: str, drafter: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from edge_sd.engines.ort import OrtEngine

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(hf_src, dtype=torch.float32).eval()
    engine = OrtEngine(engine_dir, provider="cpu", threads=2)
    rng = np.random.default_rng(0)
    vocab = min(engine.manifest.vocab_size, engine.manifest.logits_width)
    worst = {"torch": 0.0, "single": 0.0, "multi": 0.0}
    top1_agree = []
    end = PROMPT_LEN + STEPS
    for _ in range(N_PROMPTS):
        ids = rng.integers(0, vocab, size=end)
        with torch.no_grad():
            ref = model(torch.tensor(ids[None])).logits[0].numpy()  # [T+4, V]
        scale = max(1.0, float(np.abs(ref).max()))
        engine.min_step = 1
        engine.reset()
        full = engine.forward(ids)  # [T+4, V]: the reference for the engine against itself
        worst["torch"] = max(worst["torch"], _rel(full, ref, scale))
        top1_agree.append(float(np.mean(full.argmax(-1) == ref.argmax(-1))))
        worst["single"] = max(worst["single"], _rel(_steps(engine, ids, 1), full[PROMPT_LEN:], scale))
        pairs = _steps(engine, ids, 2)
        # Cut back over the four stepped positions and feed them again in one forward.
        engine.truncate(PROMPT_LEN)
        multi = engine.forward(ids[PROMPT_LEN:])
        worst["multi"] = max(worst["multi"], _rel(pairs, full[PROMPT_LEN:], scale),
                             _rel(multi, full[PROMPT_LEN:], scale))
    # Two-position steps are the price of batch consistency where single steps take other kernels
    # (int8-activation MatMulNBits: 2e-2). They cost time (Gemma-3-270M fp32: about 35 against 40 ms a
    # token), and re-feeding copies a concat-layout cache: so they are chosen only where single steps
    # are off by more than the tolerance and longer forwards are exact (fp32 single steps differ by
    # ~1e-6 of the logit scale: near-ties only, as plain decoding against any other kernel order).
    two = engine.manifest.kv_layout == "shared" and worst["single"] > CACHE_RTOL and worst["multi"] == 0.0
    min_step = 2 if two else 1
    consistency = worst["multi"] if two else max(worst["single"], worst["multi"])
    result = {
        "precision": precision,
        "prompts": N_PROMPTS,
        "prompt_len": PROMPT_LEN,
        "max_rel_diff_vs_torch": worst["torch"],
        "top1_agreement_vs_torch": float(np.mean(top1_agree)),
        "max_rel_diff_single_position": worst["single"],
        "max_rel_diff_multi_position": worst["multi"],
        "min_step_positions": min_step,
        "max_rel_diff_steps_vs_forward": consistency,
        "tolerance_vs_torch": TORCH_RTOL_FP32 if precision == "fp32" else None,
        "tolerance_cache": CACHE_RTOL,
        # A drafter's forwards need not agree with each other (the verifier uses exactly what it
        # proposed), so a drafter is not held to the cache tolerance.
        "cache_checks_required": not drafter,
    }
    failures = []
    if precision == "fp32" and worst["torch"] > TORCH_RTOL_FP32:
        failures.append(f"logits differ from torch by {worst['torch']:.2e} (relative) > {TORCH_RTOL_FP32}")
    if consistency > CACHE_RTOL and result["cache_checks_required"]:
        failures.append(f"a multi-position forward differs from single steps by {consistency:.2e} > {CACHE_RTOL}")
    if failures:
        result["error"] = "; ".join(failures)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("engine_dir", type=Path)
    ap.add_argument("hf_source")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--drafter", action="store_true", help="the engine is a drafter (see cache_checks_required)")
    args = ap.parse_args(argv)
    try:
        result = validate(args.engine_dir, args.hf_source, args.precision, args.drafter)
    except Exception as e:  # report any crash as a failed validation, in the same JSON shape
        result = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
