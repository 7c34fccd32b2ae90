"""Export: validation figures, parity with transformers, atomic folders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edge_sd.engines.ort import OrtEngine
from edge_sd.manifest import load_engine_manifest

from conftest import MODELS, OPTIMUM_ENGINES

ENGINES = {**{name: name for name in MODELS}, **OPTIMUM_ENGINES}  # engine -> the HF model it came from


@pytest.mark.parametrize("name", list(ENGINES))
def test_validation_figures_within_tolerance(tiny_root: Path, name: str) -> None:
    m = load_engine_manifest(tiny_root / "engines" / name)
    v = m.validation
    assert v["max_rel_diff_vs_torch"] <= v["tolerance_vs_torch"]
    assert v["max_rel_diff_steps_vs_forward"] <= v["tolerance_cache"]
    assert v["top1_agreement_vs_torch"] == 1.0
    assert m.min_step_positions == v["min_step_positions"]
    if m.export_path == "builder":
        # Forwards over two or more positions take one kernel path: bit-identical to each other; fp32
        # single steps are within the tolerance, so these engines step one position at a time.
        assert v["max_rel_diff_multi_position"] == 0.0
        assert m.min_step_positions == 1 and v["max_rel_diff_single_position"] <= v["tolerance_cache"]


@pytest.mark.parametrize("name", list(ENGINES))
def test_manifest_describes_the_model(tiny_root: Path, name: str) -> None:
    m = load_engine_manifest(tiny_root / "engines" / name)
    cfg = json.loads((tiny_root / "hf" / ENGINES[name] / "config.json").read_text())
    assert m.num_layers == cfg["num_hidden_layers"]
    assert m.num_kv_heads == cfg["num_key_value_heads"]
    assert m.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert m.logits_width == cfg["vocab_size"]
    builder = name not in OPTIMUM_ENGINES  # auto sends llama, qwen2 and gemma3 to the builder
    assert (m.export_path, m.kv_layout) == (("builder", "shared") if builder else ("optimum", "concat"))
    # Position ids are an input of optimum's graphs except Gemma-3's; the builder derives them.
    assert m.has_position_ids == (not builder and MODELS[ENGINES[name]][1] != "gemma3")
    assert m.bos_token_id == 2 and m.add_bos and 1 in m.eos_token_ids
    assert {f.path for f in m.files} >= {"model.onnx", "tokenizer.json"}


@pytest.mark.parametrize("name", ["sp_gemma", "bl_llama", "bl2_qwen"])
def test_greedy_equals_transformers_generate(tiny_root: Path, name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from edge_sd import GenerationConfig, Pipeline

    model = AutoModelForCausalLM.from_pretrained(tiny_root / "hf" / name).eval()
    pipe = Pipeline.from_folder(tiny_root / "engines" / name, provider="cpu", threads=2)
    for prompt in ["The cat", "def add(a, b):", "café 🙂", "  spaces  "]:
        ours = pipe.generate(prompt, GenerationConfig(max_new_tokens=24))
        ids = torch.tensor([ours.prompt_ids])
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones_like(ids))
        assert ours.token_ids == ref[0, ids.shape[1]:].tolist(), prompt


@pytest.mark.parametrize("name", ["sp_gemma", "bl_llama"])
def test_an_fp32_lm_head_in_parts_computes_the_whole_heads_logits(tiny_root: Path, tmp_path: Path, name: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """split_lm_head on an fp32 MatMul head (a target's 262k-row head in parts, for the memory of a
    launch) changes which nodes compute the logits, not one bit of them; Gemma's head is tied (its
    embedding reads the weight too, then a Concat of the parts), Llama's is not. Each engine is loaded
    twice, the second time from the runtime cache its first load saved."""
    import shutil
    from dataclasses import replace

    import onnx

    from edge_sd.engines import consistency, prepared
    from edge_sd.export.logits import split_lm_head
    from edge_sd.manifest import file_entries, save

    monkeypatch.setattr(prepared, "MIN_BYTES", 0)
    monkeypatch.delenv(prepared.ENV, raising=False)
    whole, parted = tmp_path / "whole", tmp_path / "parted"
    for folder in (whole, parted):
        shutil.copytree(tiny_root / "engines" / name, folder, ignore=shutil.ignore_patterns("runtime_cache"))
    m = load_engine_manifest(whole)
    n = m.logits_width
    assert split_lm_head(parted / "model.onnx", rows=n // 3 + 1) == 3
    save(replace(m, files=file_entries(parted)), parted)
    graph = onnx.load(str(parted / "model.onnx"), load_external_data=False).graph
    parts = [nd for nd in graph.node if nd.op_type == "MatMul" and "_part" in nd.name]
    weights = {i.name: list(i.dims) for i in graph.initializer}
    columns = [weights[nd.input[1]][1] for nd in parts]  # initializers of their own
    assert sum(columns) == n and all(c % 64 == 0 for c in columns[:-1])
    assert split_lm_head(parted / "model.onnx", rows=n // 3 + 1) == 1  # a Concat's head is left alone

    rng = np.random.default_rng(3)
    ids = rng.integers(3, 300, size=70)
    for loaded in ("saved", "loaded"):  # built from the graph, then from the one it saved (engines/prepared.py)
        a, b = (OrtEngine(f, provider="cpu", threads=2) for f in (whole, parted))
        assert a.shared.graph_cache == b.shared.graph_cache == loaded
        np.testing.assert_array_equal(a.forward(ids[:40]), b.forward(ids[:40]))
        for t in ids[40:]:  # one-position steps, across position 64
            np.testing.assert_array_equal(a.forward([t]), b.forward([t]))
        np.testing.assert_array_equal(a.forward(ids[:5]), b.forward(ids[:5]))  # five rows at once
        assert consistency.across_split(b, rng.integers(3, 300, size=consistency.SPLIT_IDS)) == 0.0


@pytest.mark.parametrize("name", ["bl_llama", "bl_llama_opt"])
def test_engine_cache_round_trip(tiny_root: Path, name: str) -> None:
    """Cutting the cache back and re-feeding gives the logits of a fresh run (runtime engine)."""
    eng = OrtEngine(tiny_root / "engines" / name, provider="cpu", threads=2)
    ids = np.arange(3, 23)
    full = eng.forward(ids)
    eng.truncate(7)
    assert eng.n_cached == 7
    again = eng.forward(ids[7:])
    np.testing.assert_allclose(again, full[7:], atol=1e-4)
    eng.reset()
    assert eng.n_cached == 0
    np.testing.assert_allclose(eng.forward(ids[:5]), full[:5], atol=1e-4)


def test_export_cli_end_to_end_and_force(tiny_root: Path, tmp_path: Path) -> None:
    import subprocess

    from typer.testing import CliRunner

    from edge_sd.tools.cli import app

    out = tmp_path / "pair"
    ended = subprocess.Popen(["true"])
    ended.wait()
    (tmp_path / f".pair.partial-{ended.pid}-abc").mkdir()  # what a killed export left: removed below
    args = ["export", "-t", str(tiny_root / "hf" / "bl_llama"), "-d", str(tiny_root / "hf" / "sp2_llama"),
            "-o", str(out)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (out / "pair.json").is_file() and (out / "maps.npz").is_file()
    assert "intersection" in r.output
    assert f"note: removed {tmp_path / f'.pair.partial-{ended.pid}-abc'}" in r.output.replace("\n", "")
    # the manifest names the folder as it is, not the one it was built in; the folder has the user's umask
    import json
    import os

    assert json.loads((out / "pair.json").read_text())["name"] == "pair"
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and "--force" in r.output
    stamp = (out / "pair.json").stat().st_mtime_ns
    r = CliRunner().invoke(app, args + ["--force", "--chat-template", "chatml"])
    assert r.exit_code == 0, r.output
    assert (out / "pair.json").stat().st_mtime_ns != stamp
    from edge_sd.export.chat_templates import CHATML
    from edge_sd.manifest import load_engine_manifest

    target, drafter = (load_engine_manifest(out / role) for role in ("target", "drafter"))
    assert (target.chat_template, target.exporter["chat_template"]) == (CHATML, "--chat-template chatml")
    assert drafter.chat_template != CHATML  # the option is the target's
    assert [p.name for p in tmp_path.iterdir()] == ["pair"]  # no temporary folder left beside it, nor the killed one's


def test_interrupted_export_leaves_nothing(tiny_root: Path, tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C halfway (after the target engine is written) leaves no folder behind."""
    import edge_sd.export.pair as pair

    real = pair.export_engine
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(pair, "export_engine", interrupted)
    from edge_sd.export.hf import ExportOptions

    out = tmp_path / "engines" / "x"
    with pytest.raises(KeyboardInterrupt):
        pair.export(str(tiny_root / "hf" / "bl_llama"), str(tiny_root / "hf" / "bl2_qwen"), out,
                    ExportOptions(validate=False))
    assert len(calls) == 2
    assert list((tmp_path / "engines").iterdir()) == []


def test_failed_export_keeps_existing_folder(tiny_root: Path, tmp_path: Path) -> None:
    from edge_sd.errors import EdgeSDError
    from edge_sd.export.hf import ExportOptions
    from edge_sd.export.pair import export

    out = tmp_path / "keep"
    out.mkdir()
    (out / "marker").write_text("old")
    with pytest.raises(EdgeSDError):
        export(str(tmp_path / "missing.gguf"), None, out, ExportOptions(), force=True)
    assert (out / "marker").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


@pytest.mark.parametrize("exporter", ["builder", "optimum"])
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_export(tiny_root: Path, tmp_path: Path, precision: str, exporter: str) -> None:
    from edge_sd import GenerationConfig, Pipeline
    from edge_sd.export.hf import ExportOptions, export_engine

    dest = tmp_path / precision
    dest.mkdir()
    m = export_engine(str(tiny_root / "hf" / "bl_llama"), dest, ExportOptions(precision=precision, exporter=exporter))
    assert (m.precision, m.export_path) == (precision, exporter)
    fp32 = sum(f.bytes for f in load_engine_manifest(tiny_root / "engines" / "bl_llama").files)
    assert sum(f.bytes for f in m.files) < fp32  # the weights did shrink
    # Quantized weights move logits; the cache checks still hold (validated at export) and the
    # model still mostly agrees with torch on the next token.
    assert m.validation["top1_agreement_vs_torch"] >= 0.5
    r = Pipeline.from_folder(dest, provider="cpu").generate("The cat", GenerationConfig(max_new_tokens=8))
    assert len(r.token_ids) == 8


def test_unavailable_precision_is_a_clear_error(tiny_root: Path, tmp_path: Path) -> None:
    from edge_sd.errors import UsageError
    from edge_sd.export.hf import ExportOptions, export_engine

    src = str(tiny_root / "hf" / "bl_llama")
    with pytest.raises(UsageError, match="fp16 is not available on the optimum path"):
        export_engine(src, tmp_path, ExportOptions(precision="fp16", exporter="optimum"))
    with pytest.raises(UsageError, match="fp16 graphs are for --device cuda"):
        export_engine(src, tmp_path, ExportOptions(precision="fp16"))
    with pytest.raises(UsageError, match="--device cuda needs the builder"):
        export_engine(src, tmp_path, ExportOptions(exporter="optimum", device="cuda"))


def test_cuda_export_on_a_machine_without_cuda(tiny_root: Path, tmp_path: Path) -> None:
    """`--precision fp16 --device cuda` writes the builder's CUDA graph here too: not validated (its
    fused attention has no CPU kernel: it is measured again where it runs, engines/consistency.py),
    with float32 logits cast inside the graph (numpy's float16 argmax over a large vocabulary costs
    more than the forward on a GPU), the KV cache in fp16."""
    import onnx

    from edge_sd.export.hf import ExportOptions, export_engine
    from edge_sd.export.logits import float32_logits

    dest = tmp_path / "fp16"
    dest.mkdir()
    m = export_engine(str(tiny_root / "hf" / "bl_llama"), dest, ExportOptions(precision="fp16", device="cuda"))
    assert (m.precision, m.kv_dtype, m.validation, m.min_step_positions, m.device) == ("fp16", "float16", {}, 1, "cuda")
    graph = onnx.load(str(dest / m.model_file), load_external_data=False).graph
    (logits,) = [o for o in graph.output if o.name == "logits"]
    assert logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [n.op_type for n in graph.node if "logits" in n.output] == ["Cast"]
    assert not float32_logits(dest / m.model_file)  # float32 already: nothing to do
    # RDK's kernel runs the models: with --device cuda that needs CUDA, said before any export starts.
    from edge_sd.errors import UsageError
    from edge_sd.export.pair import export

    hf = tiny_root / "hf"
    with pytest.raises(UsageError, match="needs a machine with CUDA"):
        export(str(hf / "bl_llama"), str(hf / "bl2_qwen"), tmp_path / "pair", ExportOptions(precision="fp16",
               device="cuda"), vocab_keep=0.5)
    assert not (tmp_path / "pair").exists()


def test_pair_with_quantized_drafter(tiny_root: Path, tmp_path: Path) -> None:
    """--drafter-precision: the drafter takes the fast kernels (not batch-consistent, which a drafter
    need not be), the target stays fp32, and speculative output still equals plain decoding."""
    from edge_sd import GenerationConfig, Pipeline
    from edge_sd.export.hf import ExportOptions
    from edge_sd.export.pair import export

    out = tmp_path / "pair"
    export(str(tiny_root / "hf" / "bl_llama"), str(tiny_root / "hf" / "bl2_qwen"), out, ExportOptions(),
           drafter_opts=ExportOptions(precision="int8"))
    target, drafter = load_engine_manifest(out / "target"), load_engine_manifest(out / "drafter")
    assert (target.precision, drafter.precision) == ("fp32", "int8")
    assert target.validation["cache_checks_required"] and not drafter.validation["cache_checks_required"]
    assert target.validation["max_rel_diff_steps_vs_forward"] <= target.validation["tolerance_cache"]
    pipe = Pipeline.from_folder(out, provider="cpu", threads=2)
    for prompt in ("The cat", "def add(a, b):", "café naïve"):
        plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=16, algorithm="ar")).token_ids
        for algo in ("slem", "tli", "slrs"):
            spec = pipe.generate(prompt, GenerationConfig(max_new_tokens=16, algorithm=algo, lookahead=3))
            assert spec.token_ids == plain, (algo, prompt)


def test_pair_with_pruned_quantized_drafter(tiny_root: Path, tmp_path: Path) -> None:
    """--drafter-vocab-keep on a MatMulNBits (int4) head, with a corpus file: the export prunes the
    head, writes the kernel, and every algorithm, RDK too, still equals plain decoding."""
    import numpy as np

    from edge_sd import GenerationConfig, Pipeline
    from edge_sd.export.hf import ExportOptions
    from edge_sd.export.pair import export
    from edge_sd.manifest import load_pair_manifest

    import tiny

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(tiny.corpus()), encoding="utf-8")
    out = tmp_path / "pair"
    summary = export(str(tiny_root / "hf" / "sp_gemma"), str(tiny_root / "hf" / "bl2_qwen"), out, ExportOptions(),
                     drafter_opts=ExportOptions(precision="int4"), vocab_keep=0.4, corpus=[corpus])
    drafter = load_engine_manifest(out / "drafter")
    kept = np.load(out / "drafter" / drafter.kept_ids_file)
    assert drafter.precision == "int4" and drafter.logits_width == len(kept) == round(0.4 * 384)
    assert summary["pair"]["pruned_head_max_rel_diff"] <= 1e-4
    assert load_pair_manifest(out).rdk_file == "rdk.npz"
    pipe = Pipeline.from_folder(out, provider="cpu", threads=2, verify=True)
    for prompt in ("The cat", "def add(a, b):", "café naïve"):
        plain = pipe.generate(prompt, GenerationConfig(max_new_tokens=16, algorithm="ar")).token_ids
        for algo in ("slem", "tli", "slrs", "rdk"):
            spec = pipe.generate(prompt, GenerationConfig(max_new_tokens=16, algorithm=algo, lookahead=3))
            assert spec.token_ids == plain, (algo, prompt)


def test_head_size_the_builder_cannot_run(tiny_root: Path, tmp_path: Path) -> None:
    """A Qwen2 with head size 8: ONNX Runtime's GroupQueryAttention takes multiples of 16 only. auto
    exports it through optimum (a working engine), an explicit --exporter builder is refused with the
    constraint named."""
    from edge_sd.errors import UsageError
    from edge_sd.export.hf import ExportOptions, export_engine

    import tiny

    hf = tiny.build_model(tmp_path / "hf", tiny.train_byte_level(300), "qwen2", seed=7, steps=20, hidden_size=32)
    assert json.loads((hf / "config.json").read_text())["hidden_size"] // 4 == 8
    m = export_engine(str(hf), _empty(tmp_path / "auto"), ExportOptions())
    assert m.export_path == "optimum" and m.head_dim == 8 and m.validation["top1_agreement_vs_torch"] == 1.0
    with pytest.raises(UsageError, match="head size is 8.*multiples of 16"):
        export_engine(str(hf), _empty(tmp_path / "builder"), ExportOptions(exporter="builder"))


def test_auto_falls_back_to_optimum_when_the_builder_fails(tiny_root: Path, tmp_path: Path, monkeypatch) -> None:
    """Where the builder's engine cannot be built or does not validate, auto exports through optimum
    (and says so); an explicit --exporter builder fails."""
    from edge_sd.errors import ExportError
    from edge_sd.export import builder
    from edge_sd.export.hf import ExportOptions, export_engine

    def broken(*args, **kwargs):
        raise ExportError("the model builder could not build it: simulated")

    monkeypatch.setattr(builder, "build", broken)
    said: list[str] = []

    def step(name: str):
        from contextlib import nullcontext

        said.append(name)
        return nullcontext()

    m = export_engine(str(tiny_root / "hf" / "bl_llama"), _empty(tmp_path / "auto"), ExportOptions(), step=step)
    assert m.export_path == "optimum" and m.validation["top1_agreement_vs_torch"] == 1.0
    assert any("exporting with optimum instead" in s and "simulated" in s for s in said)
    with pytest.raises(ExportError, match="simulated"):
        export_engine(str(tiny_root / "hf" / "bl_llama"), _empty(tmp_path / "builder"),
                      ExportOptions(exporter="builder"))


def _empty(folder: Path) -> Path:
    folder.mkdir(parents=True)
    return folder
