"""Hugging Face model id, local folder or GGUF file -> engine folder (ONNX with KV I/O + manifest)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from edge_sd import __version__
from edge_sd.engines.providers import available_providers
from edge_sd.errors import ExportError, UsageError
from edge_sd.export import chat_templates
from edge_sd.export.logits import add_logits_to_keep, float32_logits, split_lm_head
from edge_sd.layout import TOKENIZER_FILE
from edge_sd.manifest import (
    FORMAT_VERSION,
    PRECISIONS,
    EngineManifest,
    file_entries,
    save,
)
from edge_sd.scratch import scratch_folder

TASK = "text-generation-with-past"
# End-of-turn markers of common chat formats: generation stops at them as at EOS when they exist.
CHAT_END_MARKERS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")
# Precisions each export path implements; the rest are accepted names that error clearly.
SUPPORTED_PRECISIONS = {"builder": ("fp32", "fp16", "int8", "int4", "gguf"),
                        "optimum": ("fp32", "int8", "int4", "gguf")}
EXPORTERS = ("auto", "builder", "optimum")
DEVICES = ("cpu", "cuda")

Step = Callable[[str], Any]  # a progress callback: returns a context manager for one named step


@dataclass(frozen=True)
class ExportOptions:
    # auto: gguf (the file's own quantized weights) for a GGUF source, fp32 for the rest
    precision: str = "auto"
    max_context: int | None = None
    validate: bool = True
    opset: int | None = None
    # A drafter needs no batch consistency (whatever its forward gives is what it proposes, and the
    # verifier uses exactly that), so a quantized drafter takes the faster int8-activation kernels.
    drafter: bool = False
    # auto: onnxruntime-genai's model builder for the architectures it handles (fused attention, one
    # shared KV buffer per layer), optimum's generic export for the rest.
    exporter: str = "auto"
    device: str = "cpu"  # what the builder's graph is made for: cpu, or cuda (fp16 / int4)
    chat_template: str | None = None  # a built-in name or a jinja2 file (export/chat_templates.py)

    def check(self, src: str) -> None:
        """Refuse impossible values for `src` before anything is read or downloaded."""
        resolve_precision(self.precision, src)
        if self.exporter not in EXPORTERS:
            raise UsageError(f"unknown exporter {self.exporter!r}; choose one of {', '.join(EXPORTERS)}")
        if self.device not in DEVICES:
            raise UsageError(f"unknown device {self.device!r}; choose one of {', '.join(DEVICES)}")
        if self.max_context is not None and self.max_context < 1:
            raise UsageError(f"--max-context must be a positive number of positions, got {self.max_context}")
        chat_templates.check(self.chat_template)


def resolve_precision(precision: str, src: str) -> str:
    """`auto` -> gguf for a GGUF file, fp32 otherwise; gguf only for a GGUF file."""
    gguf = src.lower().endswith(".gguf")
    if precision == "auto":
        return "gguf" if gguf else "fp32"
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}; choose auto or one of {', '.join(PRECISIONS)}")
    if precision == "gguf" and not gguf:
        raise UsageError(f"precision gguf keeps a GGUF file's quantized weights; {src} is not a .gguf file")
    return precision


def _null_step(name: str) -> Any:
    from contextlib import nullcontext

    return nullcontext()


def source_name(src: str) -> str:
    """A folder-friendly name for a source: `org/Model-1B` -> `model-1b`, `x.Q4.gguf` -> `x.q4`."""
    base = Path(src.rstrip("/")).name
    base = re.sub(r"\.gguf$", "", base, flags=re.I)
    return re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-") or "model"


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def resolve_source(src: str, workdir: Path, step: Step, fields: dict[str, Any] | None = None) -> tuple[str, Any]:
    """Return (a path or id that `from_pretrained` reads, the HF tokenizer or None).

    A GGUF file (`fields`: its metadata, gguf_tokenizer.read_fields) is dequantized through
    transformers into an HF folder under `workdir`; the export and the validation subprocess then read
    that folder instead of parsing the GGUF twice.
    """
    from transformers import AutoTokenizer

    path = Path(src)
    if src.lower().endswith(".gguf"):
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        from edge_sd.export.gguf_tokenizer import read_fields, scalar

        fields = read_fields(path) if fields is None else fields
        arch = scalar(fields, "general.architecture")
        readable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer", "tokenizer_config"})
        if arch not in readable:
            raise UsageError(f"{src}: architecture {arch!r} is not one transformers reads from GGUF (it reads "
                             f"{', '.join(readable)}); export its Hugging Face folder")
        hf_dir = workdir / "hf"
        with step(f"load {path.name} (GGUF, dequantized to fp32)"):
            try:
                model = load_gguf(path, fields)
            except Exception as e:
                raise ExportError(f"could not load GGUF {src}: {_short(e)}") from None
            model.save_pretrained(hf_dir)
        # Not the tokenizer transformers builds from the file, which encodes otherwise than llama.cpp
        # and may name other special ids: the file's own (gguf_tokenizer.py), or --tokenizer.
        return str(hf_dir), None
    if path.exists() and not path.is_dir():
        raise UsageError(f"{src} is a file but not a .gguf; pass a GGUF file, an HF folder or a model id")
    if not path.exists() and (src.startswith((".", "/")) or src.count("/") > 1):
        raise UsageError(f"source {src} not found (not a folder, a .gguf file or a model id)")
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception:
        tok = None  # a model without an HF tokenizer still exports with --tokenizer
    return src, tok


def load_gguf(path: Path, fields: dict[str, Any]) -> Any:
    """The GGUF file's model through transformers, its weights dequantized to fp32 and its
    configuration as llama.cpp reads the file (`fields`: its metadata, gguf_tokenizer.read_fields)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from edge_sd.export.gguf_tokenizer import scalar

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    _as_llama_cpp_reads(config, scalar(fields, "general.architecture"), fields)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config,
                                                dtype="float32")


# llama.cpp scales Gemma-2 and Gemma-3 queries by the head size, except in its 27B layouts (by this
# many layers), by hidden size / heads.
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _as_llama_cpp_reads(config: Any, arch: str, fields: dict[str, Any]) -> None:
    """What transformers takes from its defaults where the GGUF file, as llama.cpp reads it, says
    otherwise: the head size (Qwen3's default 128), Phi-3's training context and Gemma's query scale
    (its default 256)."""
    from edge_sd.export.gguf_tokenizer import scalar

    head_dim = scalar(fields, f"{arch}.attention.key_length")
    if head_dim and getattr(config, "head_dim", head_dim) != head_dim:
        config.head_dim = int(head_dim)
    if arch == "phi3" and hasattr(config, "original_max_position_embeddings"):
        # Phi-3's training context: where the file names none, the context it runs at (a 4k model); the
        # default (4096) would make any other context look like a LongRoPE model to the builder
        original = scalar(fields, "phi3.rope.scaling.original_context_length") or scalar(fields, "phi3.context_length")
        if original:
            config.original_max_position_embeddings = int(original)
    if arch in GEMMA_27B_LAYERS and hasattr(config, "query_pre_attn_scalar"):
        hidden, heads = scalar(fields, f"{arch}.embedding_length"), scalar(fields, f"{arch}.attention.head_count")
        big = scalar(fields, f"{arch}.block_count") == GEMMA_27B_LAYERS[arch]
        config.query_pre_attn_scalar = int(hidden // heads if big else (head_dim or config.head_dim))


def tokenizer_file(override: str) -> Path:
    """The tokenizer.json that --tokenizer names (the file or its folder)."""
    p = Path(override)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise UsageError(f"tokenizer {override} not found (give a tokenizer.json or its folder)")
    return p


def _tokenizer_json(tok: Any, override: str | None, dest: Path) -> dict:
    """Write `tokenizer.json` into dest from --tokenizer or from the model's own fast tokenizer."""
    if override:
        shutil.copyfile(tokenizer_file(override), dest / TOKENIZER_FILE)
    elif tok is not None and getattr(tok, "is_fast", False):
        tok.backend_tokenizer.save(str(dest / TOKENIZER_FILE))
    else:
        raise ExportError("the model has no fast tokenizer to export; pass --tokenizer tokenizer.json")
    try:
        return json.loads((dest / TOKENIZER_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{override}: not a valid tokenizer.json ({e})") from None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _special_tokens(tj: dict, tok: Any, config: Any, gen: Any) -> tuple[int | None, bool, list[int], int | None]:
    from tokenizers import Tokenizer

    t = Tokenizer.from_str(json.dumps(tj))
    bos = config.bos_token_id if getattr(config, "bos_token_id", None) is not None else None
    if bos is None and tok is not None:
        bos = tok.bos_token_id
    if isinstance(bos, list):
        bos = bos[0] if bos else None
    # BOS goes in front of a prompt when the tokenizer itself would add it; the runtime then adds it
    # explicitly (add_bos), so that hosts in other languages need no post-processor.
    with_special = t.encode("a", add_special_tokens=True).ids
    without = t.encode("a", add_special_tokens=False).ids
    add_bos = bos is not None and len(with_special) > len(without) and with_special[0] == bos
    eos = _ids(getattr(config, "eos_token_id", None)) + _ids(getattr(gen, "eos_token_id", None))
    if tok is not None and tok.eos_token_id is not None:
        eos.append(int(tok.eos_token_id))
    for marker in CHAT_END_MARKERS:
        mid = t.token_to_id(marker)
        if mid is not None:
            eos.append(mid)
    pad = getattr(config, "pad_token_id", None)
    return bos, add_bos, sorted(set(eos)), pad if isinstance(pad, int) else None


def chat_template(tok: Any, tokenizer: str | None, tj: dict, option: str | None,
                  fields: dict[str, Any] | None = None) -> tuple[str | None, str]:
    """The engine's chat template and where it came from: `--chat-template`, the tokenizer_config.json
    beside `--tokenizer`, the model's own tokenizer, a GGUF file's metadata (`fields`), or else the
    built-in format whose turn markers the vocabulary holds (`inspect` shows which)."""
    from tokenizers import Tokenizer

    from edge_sd.export.gguf_tokenizer import scalar

    if option:
        return chat_templates.from_option(option), f"--chat-template {option}"
    own = _tokenizer_chat_template(tok, tokenizer)
    if own:
        return own, "tokenizer_config.json beside --tokenizer" if tokenizer else "the model's tokenizer"
    in_file = scalar(fields or {}, "tokenizer.chat_template")
    if in_file:
        return in_file, "the GGUF file's metadata"
    t = Tokenizer.from_str(json.dumps(tj))
    name = chat_templates.guess(lambda token: t.token_to_id(token) is not None)
    if name:
        return chat_templates.BUILTIN[name][0], f"built-in {name} (the source has none; its vocabulary has its markers)"
    return None, "none (chat needs --chat-template at export)"


def _tokenizer_chat_template(tok: Any, override: str | None) -> str | None:
    if override:
        cfg = Path(override)
        cfg = (cfg if cfg.is_dir() else cfg.parent) / "tokenizer_config.json"
        if cfg.is_file():
            template = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, str):
                return template
    template = getattr(tok, "chat_template", None) if tok is not None else None
    return template if isinstance(template, str) else None


def choose_exporter(requested: str, config: Any, hf_src: str) -> str:
    """The export path for a model: `auto` takes the builder where it handles the architecture and
    is installed, and the model is a local folder (the builder reads one)."""
    import importlib.util

    from edge_sd.export.builder import BUILDER_ARCHITECTURES, unsupported_reason

    if requested not in EXPORTERS:
        raise UsageError(f"unknown exporter {requested!r}; choose one of {', '.join(EXPORTERS)}")
    if requested != "auto":
        return requested
    arch = (getattr(config, "architectures", None) or [""])[0]
    usable = Path(hf_src).is_dir() and importlib.util.find_spec("onnxruntime_genai") is not None
    return "builder" if arch in BUILDER_ARCHITECTURES and usable and not unsupported_reason(config.to_dict()) \
        else "optimum"


def export_engine(
    src: str,
    dest: Path,
    opts: ExportOptions,
    tokenizer: str | None = None,
    step: Step = _null_step,
    name: str | None = None,
) -> EngineManifest:
    """Export one model into `dest` (an existing, empty folder) and validate it."""
    opts = replace(opts, precision=resolve_precision(opts.precision, src))
    _quiet()
    workdir = scratch_folder(Path(tempfile.gettempdir()), "edge-sd-export-")
    try:
        return _export_engine_in(src, dest, opts, tokenizer, step, name, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _export_engine_in(src: str, dest: Path, opts: ExportOptions, tokenizer: str | None, step: Step, name: str | None,
                      workdir: Path) -> EngineManifest:
    from transformers import AutoConfig, GenerationConfig

    fields = None
    if src.lower().endswith(".gguf"):
        from edge_sd.export import gguf_tokenizer

        if not Path(src).is_file():
            raise UsageError(f"GGUF file {src} not found")
        fields = gguf_tokenizer.read_fields(Path(src))  # once: 262k tokens take seconds to parse
    hf_src, tok = resolve_source(src, workdir, step, fields)
    try:
        config = AutoConfig.from_pretrained(hf_src)
    except Exception as e:
        raise ExportError(f"could not read the model config of {src}: {_short(e)}") from None
    try:
        gen = GenerationConfig.from_pretrained(hf_src)
    except Exception:
        gen = None
    stops: tuple[int, ...] = ()
    if tokenizer is None and src.lower().endswith(".gguf"):
        # The file's own tokenizer, as llama.cpp reads it (the one transformers builds from a GGUF file
        # encodes otherwise: export/gguf_tokenizer.py).
        from edge_sd.export import gguf_tokenizer

        with step(f"tokenizer from {Path(src).name}'s metadata"):
            own = workdir / TOKENIZER_FILE
            meta = gguf_tokenizer.read(Path(src), fields)
            own.write_text(json.dumps(gguf_tokenizer.tokenizer_json(meta)), encoding="utf-8")
            stops = tuple(gguf_tokenizer.stop_ids(meta))
        tj = _tokenizer_json(None, str(own), dest)
    else:
        tj = _tokenizer_json(tok, tokenizer, dest)
    path = choose_exporter(opts.exporter, config, hf_src)
    if opts.precision not in SUPPORTED_PRECISIONS[path]:
        raise UsageError(f"precision {opts.precision} is not available on the {path} path; use one of "
                         f"{', '.join(SUPPORTED_PRECISIONS[path])}")
    # auto falls back to optimum where the builder cannot make an engine that validates (a model
    # it accepts but builds wrongly or unrunnably), when optimum can make this precision.
    fallback = (opts.exporter == "auto" and path == "builder" and opts.device == "cpu"
                and opts.precision in SUPPORTED_PRECISIONS["optimum"])
    chat = chat_template(tok, tokenizer, tj, opts.chat_template, fields)
    with step(f"chat template: {chat[1]}"):
        pass
    job = _Job(src, hf_src, dest, workdir, opts, step, config, gen, tok, tj, name or source_name(src), tokenizer, chat,
               stops)
    try:
        return _export_path(job, path)
    except ExportError as e:
        if not fallback:
            raise
        for f in dest.iterdir():
            if f.name != TOKENIZER_FILE:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        with step(f"the model builder's engine failed ({e}); exporting with optimum instead"):
            pass
        return _export_path(job, "optimum")


@dataclass(frozen=True)
class _Job:
    """What one engine's export reads, whichever path builds it."""

    src: str
    hf_src: str
    dest: Path
    workdir: Path
    opts: ExportOptions
    step: Step
    config: Any
    gen: Any
    tok: Any
    tj: dict
    name: str
    tokenizer: str | None
    chat: tuple[str | None, str]  # the chat template and where it came from
    stops: tuple[int, ...] = ()  # a GGUF file's own end-of-generation ids, where its tokenizer is used


def _export_path(job: _Job, path: str) -> EngineManifest:
    """Build the engine through one export path, write its manifest and validate it."""
    src, hf_src, dest, opts, step = job.src, job.hf_src, job.dest, job.opts, job.step
    gguf = opts.precision == "gguf"
    if gguf and opts.device != "cpu":
        raise UsageError("precision gguf makes CPU graphs (MatMulNBits with int8 activations); use --device cpu")
    # gguf: an fp32 graph first (the file dequantized), whose weights are then swapped for the file's
    # own blocks.
    build_opts = replace(opts, precision="fp32") if gguf else opts
    if path == "builder":
        from edge_sd.export.builder import build

        with step(f"build {source_name(src)} with the model builder ({build_opts.precision}, {opts.device})"):
            build(hf_src, dest / TOKENIZER_FILE, dest, build_opts.precision, opts.device, job.workdir)
    else:
        if opts.device != "cpu":
            raise UsageError("--device cuda needs the builder path (--exporter builder)")
        _optimum_export(src, hf_src, dest, job.workdir, build_opts, step)
    add_logits_to_keep(dest / "model.onnx")  # a prefill then computes the LM head once, not per position
    float32_logits(dest / "model.onnx")
    quantization: dict = {}
    if gguf:  # after logits_to_keep: an LM head's offset correction then sums the kept positions only
        from edge_sd.export.builder import ACCURACY_LEVEL
        from edge_sd.export.gguf_graph import requantize

        with step(f"carry {Path(src).name}'s quantized weights into the graph (exactly)"):
            quantization = {"source": "gguf", "accuracy_level": ACCURACY_LEVEL,
                            **requantize(dest / "model.onnx", Path(src), ACCURACY_LEVEL)}
    if (gguf or opts.precision == "fp32") and opts.device == "cpu" and not opts.drafter:
        # A target's 262k-row head in parts: ONNX Runtime's repacking at each launch holds one part's
        # copies at a time, not the whole head's (a drafter's head is small, and RDK prunes it whole).
        parts = split_lm_head(dest / "model.onnx")
        if gguf or parts > 1:
            quantization["lm_head_parts"] = parts
    previous_row, pasts, window, grouped = False, [], 0, []
    if gguf and not opts.drafter:
        # int8 activations round a one-row attention kernel's difference into the logits: the
        # attention of a target's one-position step takes the previous position from its cache.
        from edge_sd.export.attention_steps import rewrite, window_views
        from edge_sd.export.grouped_attention import grouped_global

        with step("attention over the previous position too (one-position steps)"):
            previous_row = rewrite(dest / "model.onnx") > 0
        if previous_row:
            with step("sliding-window layers over a view of their cache"):
                pasts, window = window_views(dest / "model.onnx")
            with step("global layers as one product over their heads"):
                grouped = grouped_global(dest / "model.onnx")
    lm_head = {}
    if gguf and not opts.drafter:
        from edge_sd.export.logits import expose_head

        lm_head = expose_head(dest / "model.onnx")  # last: it points into the weights file as written
    manifest = _manifest(src, dest, job.config, job.gen, job.tok, job.tj, opts, job.name, job.tokenizer, path,
                         job.chat, job.stops)
    views: dict = {}
    layer_of = {manifest.past_key_template.format(i=i): i for i in range(manifest.num_layers)}
    if previous_row and pasts:
        views = {"layers": sorted(layer_of[p] for p in pasts), "window": window, "granule": 0}  # granule: validation
    manifest = replace(manifest, quantization=quantization, previous_row_attention=previous_row, window_views=views,
                       grouped_attention=sorted(layer_of[p] for p in grouped), lm_head=lm_head)
    save(manifest, dest)
    if opts.validate and opts.device == "cuda" and "cuda" not in available_providers():
        # A CUDA graph's fused ops (GroupQueryAttention with the Q/K norms folded in) have no CPU
        # kernel, so it can only be run where CUDA is: the folder is written, marked not validated.
        with step("not validated: a graph for CUDA, and this onnxruntime has no CUDA provider"):
            pass
    elif opts.validate:
        with step(f"validate against torch (subprocess, {opts.device})"):
            figures = run_validation(dest, hf_src, opts.precision, opts.drafter, opts.device)
        if views:
            views = {**views, "granule": figures.get("window_granule", 0)}
        manifest = EngineManifest(**{**manifest.__dict__, "validation": figures,
                                     "min_step_positions": figures["min_step_positions"],
                                     "min_head_rows": figures["min_head_rows"], "window_views": views})
        save(manifest, dest)
    return manifest


def _optimum_export(src: str, hf_src: str, dest: Path, workdir: Path, opts: ExportOptions, step: Step) -> None:
    """optimum's text-generation-with-past export (concat KV layout), weight-quantized if asked."""
    from optimum.exporters.onnx import main_export

    onnx_dir = workdir / "onnx"
    with step(f"export {source_name(src)} to ONNX ({TASK})"):
        try:
            main_export(
                hf_src, onnx_dir, task=TASK, opset=opts.opset, do_validation=False,
                no_post_process=False, library_name="transformers",
            )
        except Exception as e:
            raise ExportError(f"optimum could not export {src}: {_short(e)}") from None
    for f in onnx_dir.iterdir():
        if f.name.startswith("model.onnx"):
            shutil.move(str(f), dest / f.name)
    if opts.precision in ("int8", "int4"):
        from edge_sd.export.quantize import quantize

        with step(f"quantize to {opts.precision}"):
            quantize(dest, opts.precision, batch_consistent=not opts.drafter)


def _manifest(
    src: str, dest: Path, config: Any, gen: Any, tok: Any, tj: dict, opts: ExportOptions,
    name: str, tokenizer: str | None, path: str, chat: tuple[str | None, str], stops: tuple[int, ...] = (),
) -> EngineManifest:
    import onnx
    import torch
    import transformers

    model = onnx.load(str(dest / "model.onnx"), load_external_data=False)
    inputs = {i.name: i for i in model.graph.input}
    outputs = [o.name for o in model.graph.output]
    n_layers = sum(1 for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
    k0 = inputs["past_key_values.0.key"].type.tensor_type
    dims = [d.dim_value for d in k0.shape.dim]
    kv_dtype = "float16" if k0.elem_type == onnx.TensorProto.FLOAT16 else "float32"
    logits_dims = [d.dim_value for d in next(o for o in model.graph.output if o.name == "logits")
                   .type.tensor_type.shape.dim]
    bos, add_bos, eos, pad = _special_tokens(tj, tok, config, gen)
    eos = sorted(set(eos) | set(stops))
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_str(json.dumps(tj)).get_vocab_size(with_added_tokens=True)
    max_ctx = int(getattr(config, "max_position_embeddings", 0) or 2048)
    if opts.max_context:
        max_ctx = min(max_ctx, opts.max_context)
    heads = int(config.num_attention_heads)
    # The builder leaves the head size symbolic in the graph's KV inputs.
    head_dim = dims[3] or int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    tool = {"builder": "onnxruntime-genai", "optimum": "optimum-onnx"}[path]
    return EngineManifest(
        format_version=FORMAT_VERSION,
        name=name,
        architecture=str(config.model_type),
        num_layers=n_layers,
        num_attention_heads=heads,
        num_kv_heads=dims[1],
        head_dim=head_dim,
        hidden_size=int(config.hidden_size),
        kv_dtype=kv_dtype,
        precision=opts.precision,
        logits_width=logits_dims[-1] or int(config.vocab_size),
        vocab_size=vocab_size,
        bos_token_id=bos,
        add_bos=add_bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        has_position_ids="position_ids" in inputs,
        max_context=max_ctx,
        sliding_window=getattr(config, "sliding_window", None),
        model_file="model.onnx",
        tokenizer_file=TOKENIZER_FILE,
        input_names=list(inputs),
        output_names=outputs,
        chat_template=chat[0],
        source=src,
        kv_layout="shared" if path == "builder" else "concat",
        export_path=path,
        device=opts.device,
        exporter={
            "edge_sd": __version__,
            tool.replace("-", "_"): _version(tool),
            "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0],
            "onnx": onnx.__version__,
            # where the engine's tokenizer.json came from (`inspect` shows it)
            "tokenizer": f"--tokenizer {tokenizer}" if tokenizer else
            "the GGUF file's metadata" if src.lower().endswith(".gguf") else "the model's own",
            "chat_template": chat[1],
        },
        files=file_entries(dest),
    )


def run_validation(engine_dir: Path, hf_src: str, precision: str, drafter: bool = False,
                   provider: str = "cpu") -> dict:
    """Run export/validate.py in a subprocess (torch and ORT in one process can fight over threads
    and memory; a crash there must not take the export's clean-up with it)."""
    cmd = [sys.executable, "-m", "edge_sd.export.validate", str(engine_dir), hf_src, "--precision", precision,
           "--provider", provider]
    cmd += ["--drafter"] if drafter else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        if lines:
            detail = json.loads(lines[-1]).get("error", detail)
        raise ExportError(f"validation of {engine_dir.name} failed: {detail}")
    return json.loads(lines[-1])


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def _short(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
