"""Check an exported engine against torch and against itself (run as a subprocess by the exporter).

    python -m edge_sd.export.validate ENGINE_DIR HF_SOURCE [--precision fp32]

Prints one JSON line of figures; exits 1 (with an "error" key) when a check fails.
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
N_PROMPTS = 3


def _scale(x: np.ndarray) -> float:
    return max(1.0, float(np.abs(x).max()))


def validate(engine_dir: Path, hf_src: str, precision: str, drafter: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from edge_sd.engines.ort import OrtEngine

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(hf_src, dtype=torch.float32).eval()
    engine = OrtEngine(engine_dir, provider="cpu", threads=2)
    rng = np.random.default_rng(0)
    vocab = min(engine.manifest.vocab_size, engine.manifest.logits_width)
    worst = {"torch": 0.0, "step": 0.0, "multi": 0.0, "truncate": 0.0}
    top1_agree = []
    for _ in range(N_PROMPTS):
        ids = rng.integers(0, vocab, size=PROMPT_LEN + 4)
        with torch.no_grad():
            ref = model(torch.tensor(ids[None])).logits[0].numpy()  # [T+4, V]
        s = _scale(ref)
        engine.reset()
        full = engine.forward(ids[: PROMPT_LEN + 1])  # [T+1, V]
        worst["torch"] = max(worst["torch"], float(np.abs(full - ref[: PROMPT_LEN + 1]).max()) / s)
        top1_agree.append(float(np.mean(full.argmax(-1) == ref[: PROMPT_LEN + 1].argmax(-1))))
        # prefill T, then one step == the full forward's last row
        engine.reset()
        engine.forward(ids[:PROMPT_LEN])
        step = engine.forward(ids[PROMPT_LEN : PROMPT_LEN + 1])[0]
        worst["step"] = max(worst["step"], float(np.abs(step - full[PROMPT_LEN]).max()) / s)
        # a multi-token forward over the cache == step-by-step forwards
        multi = engine.forward(ids[PROMPT_LEN + 1 : PROMPT_LEN + 4])
        engine.truncate(PROMPT_LEN + 1)
        singles = np.stack([engine.forward(ids[j : j + 1])[0] for j in range(PROMPT_LEN + 1, PROMPT_LEN + 4)])
        worst["multi"] = max(worst["multi"], float(np.abs(multi - singles).max()) / s)
        # cut the cache back and re-feed: same logits
        engine.truncate(PROMPT_LEN)
        again = engine.forward(ids[PROMPT_LEN : PROMPT_LEN + 1])[0]
        worst["truncate"] = max(worst["truncate"], float(np.abs(again - step).max()) / s)
    result = {
        "precision": precision,
        "prompts": N_PROMPTS,
        "prompt_len": PROMPT_LEN,
        "max_rel_diff_vs_torch": worst["torch"],
        "top1_agreement_vs_torch": float(np.mean(top1_agree)),
        "max_rel_diff_cached_step": worst["step"],
        "max_rel_diff_multi_token": worst["multi"],
        "max_rel_diff_after_truncate": worst["truncate"],
        "tolerance_vs_torch": TORCH_RTOL_FP32 if precision == "fp32" else None,
        "tolerance_cache": CACHE_RTOL,
        # A quantized drafter runs int8-activation kernels whose k-token forwards differ from single
        # steps; harmless for a drafter (the verifier uses exactly what it proposed), so not checked.
        "cache_checks_required": not (drafter and precision != "fp32"),
    }
    failures = []
    if precision == "fp32" and worst["torch"] > TORCH_RTOL_FP32:
        failures.append(f"logits differ from torch by {worst['torch']:.2e} (relative) > {TORCH_RTOL_FP32}")
    for key in ("step", "multi", "truncate"):
        if worst[key] > CACHE_RTOL and result["cache_checks_required"]:
            failures.append(f"KV-cache check '{key}' differs by {worst[key]:.2e} > {CACHE_RTOL}")
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
