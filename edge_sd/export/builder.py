"""HF folder -> ONNX graph through onnxruntime-genai's model builder (GroupQueryAttention, shared KV buffer).

The builder is run as a subprocess (`python -m onnxruntime_genai.models.builder`): it loads the model
with torch, prints per-tensor progress bars and holds gigabytes while it writes; a crash there must
not take the export's clean-up with it. onnxruntime-genai 0.15.2 is pinned: its builder is the last
one that imports with the transformers release optimum-onnx needs (< 4.58; 0.16 and later import
classes that only transformers 5 has), and it handles Gemma-3's sliding-window layers from the
flat `rope_local_base_freq` that transformers 4.57 keeps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from edge_sd.errors import ExportError, UsageError

# `config.architectures[0]` values that `--exporter auto` sends to the builder: the ones it builds
# and that the tests or the real pair cover (Llama, Qwen2, Gemma-3), plus the close relatives it
# handles with the same code path. Anything else goes to optimum.
BUILDER_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Gemma3ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Phi3ForCausalLM",
    "PhiForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM", "OlmoForCausalLM",
})
# Files of the builder's output folder that belong in an engine folder. genai_config.json lets
# onnxruntime-genai run the same graph (the engine benchmark compares against it).
KEEP = ("model.onnx", "model.onnx.data", "genai_config.json")
# MatMulNBits accuracy level 4: int8 activations. Level 1 (fp32 activations) has no fast 8-bit
# kernel on x86 (Gemma-3-270M int8: 700 ms a token against 13.5) and level 4 is batch-consistent
# across forwards of two or more positions (see `min_step_positions` in the manifest).
ACCURACY_LEVEL = 4


# ONNX Runtime's GroupQueryAttention, the builder's attention op, takes head sizes that are a multiple
# of this (its kernels refuse others when the graph first runs).
GQA_HEAD_MULTIPLE = 16


def unsupported_reason(config: dict) -> str | None:
    """Why the builder would build this model wrongly or unrunnably, or None. Its attention op needs a
    head size that is a multiple of 16; its Gemma-3 code hard-codes the released models' layer pattern
    (five sliding-window layers, then one full-attention layer)."""
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
    if head_dim % GQA_HEAD_MULTIPLE:
        return (f"its head size is {head_dim}, and ONNX Runtime's GroupQueryAttention (the builder's attention) "
                f"takes only multiples of {GQA_HEAD_MULTIPLE}")
    types = config.get("layer_types")
    if config.get("model_type") == "gemma3_text" and types:
        expected = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(len(types))]
        if list(types) != expected:
            return "its Gemma-3 layers do not follow the 5-sliding-1-full pattern the builder assumes"
    return None


def builder_args(precision: str, device: str, tied_embeddings: bool) -> tuple[list[str], str]:
    """Builder flags for a precision and a device, and the engine's KV dtype."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {device!r}; choose cpu or cuda")
    if precision == "fp16" and device != "cuda":
        raise UsageError("fp16 graphs are for --device cuda (ONNX Runtime's CPU kernels run fp16 slowly)")
    if precision not in ("fp32", "fp16", "int8", "int4"):
        raise UsageError(f"the builder has no precision {precision!r}")
    extra = []
    if precision in ("int8", "int4"):
        if device == "cpu":
            extra.append(f"accuracy_level={ACCURACY_LEVEL}")
        if precision == "int8" and tied_embeddings:
            # The builder would share the LM head with the embedding through a 4-bit-only gather.
            extra.append("shared_embeddings=false")
    args = ["-p", precision, "-e", device] + (["--extra_options", *extra] if extra else [])
    # fp32 on any device, and int4/int8 on the CPU, keep float32 inputs, outputs and KV.
    kv_dtype = "float16" if device == "cuda" and precision != "fp32" else "float32"
    return args, kv_dtype


def build(hf_dir: str, tokenizer_json: Path, dest: Path, precision: str, device: str, workdir: Path) -> str:
    """Build the graph of the HF folder `hf_dir` into `dest`; returns the KV dtype.

    The builder reads the weights, config and a tokenizer from one folder: a staging folder of links
    to the model's files plus the engine's own tokenizer.json (a GGUF's built-in tokenizer can be
    wrong, and --tokenizer may replace it).
    """
    src = Path(hf_dir)
    if not src.is_dir():
        raise UsageError(f"the builder reads a local HF folder; {hf_dir} is not one (export --exporter optimum)")
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    reason = unsupported_reason(config)
    if reason:
        raise UsageError(f"the model builder cannot build {src.name}: {reason} (use --exporter optimum)")
    args, kv_dtype = builder_args(precision, device, bool(config.get("tie_word_embeddings", True)))
    stage = workdir / "builder-input"
    stage.mkdir()
    for f in src.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            os.symlink(f.resolve(), stage / f.name)
    shutil.copyfile(tokenizer_json, stage / "tokenizer.json")
    (stage / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    out = workdir / "builder-output"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(stage), "-o", str(out),
           "-c", str(workdir / "builder-cache"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode != 0 or not (out / "model.onnx").is_file():
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        raise ExportError(f"the model builder could not build {src.name}: {detail.strip()[:300]} "
                          "(try --exporter optimum)")
    for name in KEEP:
        if (out / name).is_file():
            shutil.move(str(out / name), dest / name)
    return kv_dtype

