"""Export with a GGUF file's own quantized weights (precision gguf): tiny models written as GGUF files
here, in a mix of GGML types, exported through the model builder.

What is checked: every MatMul of the graph computes with the file's blocks (none left in float), the
weights ONNX Runtime computes with equal transformers' dequantization of the file bit for bit (to
within float32 rounding for formats with a minimum, which are stored centred; MatMulNBits run at
accuracy level 0 on an identity matrix, the offset correction included), the
token embedding too, an 8-bit LM head computes one row of a two-position step, an LM head in parts
computes the whole head's logits, speculative decoding on such a pair equals plain decoding, and a
type that cannot be carried exactly is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import tiny
from conftest import LLAMA_TYPES, QWEN_TYPES

pytestmark = pytest.mark.slow

PROMPTS = ["The cat", "def add(a, b):", "A small robot reads", "for i in range(10):\n"]


def _subgraph(model, inputs: list[str], output: str):
    """The nodes that compute `output` from `inputs` (and initializers), as a model of their own, with
    MatMulNBits at accuracy level 0 (weights dequantized to float: no activation rounding)."""
    import onnx
    from onnx import helper

    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    nodes, todo, seen = [], [output], set()
    while todo:
        name = todo.pop()
        if name in seen or name in inputs or name in inits or name not in producer:
            continue
        seen.add(name)
        node = producer[name]
        if node not in nodes:
            nodes.append(node)
            todo.extend(node.input)
    nodes.sort(key=lambda n: list(g.node).index(n))
    used = {i for n in nodes for i in n.input}
    copies = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        for a in c.attribute:
            if c.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
        copies.append(c)
    types = {"input_ids": onnx.TensorProto.INT64}
    graph = helper.make_graph(
        copies, "sub", [helper.make_tensor_value_info(i, types.get(i, onnx.TensorProto.FLOAT), None) for i in inputs],
        [helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None)], [inits[n] for n in used if n in inits])
    return helper.make_model(graph, opset_imports=list(model.opset_import))


def _run(model, feeds: dict) -> np.ndarray:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _assert_file_weights(got: np.ndarray, expected: np.ndarray, centred: bool, what: str) -> None:
    """Bit for bit; weights of a format with a minimum are stored centred (export/ggml.py: Blocks.centred),
    s*(q - c) + (o + c*s), which equals the file's s*q + o to within float32 rounding of each row's scale."""
    if not centred:
        np.testing.assert_array_equal(got, expected, err_msg=what)
        return
    tol = 8 * np.finfo(np.float32).eps * np.abs(expected).max(axis=1, keepdims=True)
    assert (np.abs(got - expected) <= tol).all(), what


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_every_matmul_computes_with_the_files_weights(gguf_root: Path, role: str) -> None:
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    from edge_sd.manifest import load_engine_manifest

    folder = gguf_root / "pair" / role
    m = load_engine_manifest(folder)
    q = m.quantization
    assert m.precision == "gguf" and m.export_path == "builder"
    assert q["float_matmuls"] == 0 and q["quantized_matmuls"] > 0
    types = LLAMA_TYPES if role == "target" else QWEN_TYPES
    assert set(q["weights_by_type"]) == set(types.values())
    if role == "target":
        assert m.validation["top1_agreement_vs_torch"] >= m.validation["top1_floor_vs_torch"]
    assert m.validation["max_rel_diff_steps_vs_forward"] <= m.validation["tolerance_cache"]

    model = onnx.load(str(folder / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    inits = {i.name for i in model.graph.initializer}
    # No MatMul is left with a float weight: the only float MatMuls are the offset corrections.
    assert not [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
                and not n.input[1].endswith("_offsets")]
    # MatMuls that read one input with the same kernel settings are one node (the drafter's gate and
    # up projections, both Q5_0): named after both, its weights both's rows.
    fused = [n for n in model.graph.node if n.op_type == "MatMulNBits" and "+" in n.name]
    assert len(fused) == q["fused_matmuls"] == (m.num_layers if role == "drafter" else 0)
    merged = sum(n.name.count("+") for n in fused)
    assert ops.count("MatMulNBits") == q["quantized_matmuls"] - merged and "GatherBlockQuantized" in ops
    # 8-bit storage holds q - z shifted onto the kernel's default zero point: no zero points to read
    # (Q5_0's values are centred on 16, Q6_K's on 32).
    nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    wide = [n for n in nbits if onnx.helper.get_node_attr_value(n, "bits") == 8]
    assert wide and all(len(n.input) == 3 for n in wide)

    name = "llama" if role == "target" else "qwen"
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_root), gguf_file=f"{name}.gguf", dtype=torch.float32)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    names = {n.name: n for n in model.graph.node}
    checked = 0
    for node in [n for n in model.graph.node if n.op_type == "MatMulNBits"]:
        matmul = node.name.rsplit("_Q", 1)[0]  # the builder's MatMul it replaced: /model/layers.0/attn/qkv_proj/MatMul
        path = matmul.replace("/MatMul", "")
        if path == "/lm_head":
            expected = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        else:
            layer, proj = path.split("/")[2].split(".")[1], path.rsplit("/", 1)[-1]
            group = "self_attn" if "/attn/" in path else "mlp"
            parts = ["q_proj", "k_proj", "v_proj"] if proj == "qkv_proj" else proj.split("+")
            expected = np.concatenate([sd[f"model.layers.{layer}.{group}.{p}.weight"] for p in parts])
        # The weights are what the node computes with, plus the offset correction where there is one.
        out = names[f"{matmul}/add_offsets"].output[0] if f"{matmul}/add_offsets" in names else node.output[0]
        eye = np.eye(expected.shape[1], dtype=np.float32)[None]
        got = _run(_subgraph(model, [node.input[0]], out), {node.input[0]: eye})[0]
        _assert_file_weights(got.T, expected, centred=f"{matmul}/add_offsets" in names, what=node.name)
        checked += node.name.count("+") + 1  # the builder's MatMuls this node computes
    assert checked == q["quantized_matmuls"]
    # The token embedding: every row of the table, read through GatherBlockQuantized.
    gather = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    out = gather.output[0]
    offsets = [n for n in model.graph.node if out in n.input and n.name.endswith("_offset_rows/Add")]
    out = offsets[0].output[0] if offsets else out  # the tied Q4_1 table: plus each block's minimum
    assert bool(offsets) == (role == "drafter")
    vocab = sd["model.embed_tokens.weight"].shape[0]
    rows = _run(_subgraph(model, ["input_ids"], out), {"input_ids": np.arange(vocab, dtype=np.int64)[None]})[0]
    _assert_file_weights(rows, sd["model.embed_tokens.weight"], centred=bool(offsets), what="embedding")


def test_a_gguf_targets_one_position_steps_compute_what_longer_forwards_do(gguf_root: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row attention rounds otherwise than attention over several rows, and int8 activations
    carry that into the logits: the builder's graph needed two-position steps. With each attention
    also reading the previous position back from the cache (export/attention_steps.py), a plain step
    feeds one position and computes what a verification forward computes, across the split at
    position 64 too; the same file exported without that needs two."""
    from edge_sd.engines import consistency
    from edge_sd.engines.ort import OrtEngine
    from edge_sd.export import attention_steps
    from edge_sd.export.hf import ExportOptions, export_engine
    from edge_sd.manifest import load_engine_manifest

    target, drafter = (load_engine_manifest(gguf_root / "pair" / r) for r in ("target", "drafter"))
    assert target.previous_row_attention and not drafter.previous_row_attention
    # One position where the export found a one-position step computing what longer forwards do (it
    # did on AVX-512 CPUs; on an AVX2-only AMD EPYC it did not, and the target steps two)
    one = target.validation["max_rel_diff_single_position"] == 0.0
    assert target.min_step_positions == (1 if one else 2)
    assert target.validation["max_rel_diff_steps_vs_forward"] == 0.0
    # The drafter's Q4_1 head: whether a 4-bit row alone rounds otherwise than beside another depends
    # on the CPU's kernels (it did on an AVX2-only AMD EPYC, not on an AVX-512 VNNI Xeon); the manifest
    # follows the measurement either way.
    rounds = drafter.validation["max_rel_diff_head_one_row"] > 0.0
    assert drafter.min_head_rows == (None if rounds else 1)
    engine = OrtEngine(gguf_root / "pair" / "target", provider="cpu", threads=2)
    ids = np.arange(3, 20)
    engine.forward(ids[:-1])
    step = engine.forward(ids[-1:])
    assert engine._io.get_outputs()[0].shape()[1] == 1  # one row of logits (of one position fed, or two)
    engine.reset()
    np.testing.assert_array_equal(step, engine.forward(ids, last=3)[-1:])
    rng = np.random.default_rng(1)
    assert consistency.across_split(engine, rng.integers(3, 500, size=consistency.SPLIT_IDS)) == 0.0
    # The control: the graph as the builder made it, the same weights.
    monkeypatch.setattr(attention_steps, "rewrite", lambda path: 0)
    plain = export_engine(str(gguf_root / "llama.gguf"), tmp_path, ExportOptions(),
                          tokenizer=str(gguf_root / "llama.tokenizer.json"))
    assert not plain.previous_row_attention and plain.validation["max_rel_diff_single_position"] > 0.0
    assert plain.min_step_positions == 2


def test_an_lm_head_in_parts_computes_the_whole_heads_logits(gguf_root: Path, tmp_path: Path) -> None:
    """split_lm_head (a real target's 262k-row head in parts, for the memory of a launch) changes
    which nodes compute the logits, not one bit of them: prefills, one-position steps and forwards
    across the split at 64 of a copy in parts equal the whole head's."""
    import shutil
    from dataclasses import replace

    import onnx

    from edge_sd.engines import consistency
    from edge_sd.engines.ort import OrtEngine
    from edge_sd.export.logits import split_lm_head
    from edge_sd.manifest import file_entries, load_engine_manifest, save

    whole = gguf_root / "pair" / "target"
    m = load_engine_manifest(whole)
    assert m.quantization["lm_head_parts"] == 1  # 512 rows: under HEAD_PART_BYTES' worth
    parted = tmp_path / "target"
    shutil.copytree(whole, parted, ignore=shutil.ignore_patterns("runtime_cache"))
    # Parts of whole tiles: a part of 171 rows computed its last columns otherwise (checked).
    assert split_lm_head(parted / "model.onnx", rows=200) == 3
    save(replace(m, files=file_entries(parted)), parted)
    graph = onnx.load(str(parted / "model.onnx"), load_external_data=False).graph
    parts = [n for n in graph.node if n.name.startswith("/lm_head/MatMul_Q8_part")]
    assert [onnx.helper.get_node_attr_value(n, "N") for n in parts] == [192, 192, 128]
    assert split_lm_head(parted / "model.onnx", rows=200) == 1  # a Concat's head is left alone

    a, b = (OrtEngine(f, provider="cpu", threads=2) for f in (whole, parted))
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 500, size=70)
    np.testing.assert_array_equal(a.forward(ids[:40]), b.forward(ids[:40]))
    for t in ids[40:]:  # one-position steps, across position 64
        np.testing.assert_array_equal(a.forward([t]), b.forward([t]))
    np.testing.assert_array_equal(a.forward(ids[:5]), b.forward(ids[:5]))  # five rows at once
    assert consistency.across_split(b, rng.integers(3, 500, size=consistency.SPLIT_IDS)) == 0.0


@pytest.mark.parametrize("head", ["graph", "own"])
def test_speculative_decoding_on_a_gguf_pair_equals_plain(gguf_root: Path, head: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under either LM head: the graph's, or the one the runtime computes (engines/lm_head.py; the
    portable C loop where the CPU lacks AVX-512 VNNI)."""
    from edge_sd import GenerationConfig, Pipeline
    from edge_sd.engines import lm_head

    if head == "own" and lm_head.library()[0] is None:
        pytest.skip(f"the LM head's kernel cannot be built here: {lm_head.library()[1]}")
    monkeypatch.setenv(lm_head.ENV, "1" if head == "own" else "0")
    pipe = Pipeline.from_folder(gguf_root / "pair", provider="cpu", threads=2)
    assert (pipe.target.session.head is not None) == (head == "own")
    accepted = 0
    for prompt in PROMPTS:
        plain = pipe.generate(prompt, GenerationConfig(algorithm="ar", max_new_tokens=24))
        for algo in ("slem", "tli", "slrs", "lookup", "auto"):
            r = pipe.generate(prompt, GenerationConfig(algorithm=algo, lookahead=3, max_new_tokens=24))
            assert r.token_ids == plain.token_ids, (algo, prompt)
            accepted += r.stats.accepted
    assert accepted > 0  # the drafter's proposals were verified, not only skipped


def test_a_type_that_cannot_be_carried_is_refused_by_name(gguf_root: Path, tmp_path: Path) -> None:
    """IQ4_NL (a non-uniform grid, no scale-times-integer form): gguf refuses it naming the tensor;
    fp32 (dequantized) exports the same file."""
    from edge_sd.errors import UsageError
    from edge_sd.export.hf import ExportOptions, export_engine

    path = tiny.write_gguf(gguf_root / "hf_llama", tmp_path / "iq.gguf", {**LLAMA_TYPES, "*ffn_up*": "IQ4_NL"})
    tok = str(gguf_root / "llama.tokenizer.json")
    (tmp_path / "a").mkdir()
    with pytest.raises(UsageError, match=r"blk\.0\.ffn_up\.weight is IQ4_NL.*--precision fp32"):
        export_engine(str(path), tmp_path / "a", ExportOptions(), tokenizer=tok)
    (tmp_path / "b").mkdir()
    m = export_engine(str(path), tmp_path / "b", ExportOptions(precision="fp32"), tokenizer=tok)
    assert m.precision == "fp32" and m.validation["top1_agreement_vs_torch"] == 1.0


def test_an_architecture_transformers_cannot_read_is_refused_by_name(tmp_path: Path) -> None:
    """One line naming the file and its architecture, before any work; no output folder."""
    import gguf
    from typer.testing import CliRunner

    from edge_sd.tools.cli import app

    path = tmp_path / "made-up.gguf"
    writer = gguf.GGUFWriter(str(path), "made-up")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    r = CliRunner().invoke(app, ["export", "-t", str(path), "-o", str(tmp_path / "out")])
    assert r.exit_code == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.output
    assert f"{path}: architecture 'made-up'" in r.stderr.replace("\n", "") and "qwen3" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch, layers, expected", [("gemma2", 2, 64), ("gemma2", 46, 96), ("gemma3", 62, 96),
                                                    ("qwen3", 2, None)])
def test_what_transformers_takes_from_its_defaults_comes_from_the_file(tmp_path: Path, arch: str, layers: int,
                                                                       expected: int | None) -> None:
    """The head size (transformers assumes Qwen3's 128) and Gemma's query scale (it assumes 256), as
    llama.cpp reads the file: the head size, or hidden / heads in its 27B layouts."""
    import gguf
    from transformers import Gemma2Config, Qwen3Config

    from edge_sd.export.gguf_tokenizer import read_fields
    from edge_sd.export.hf import _as_llama_cpp_reads

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(384)
    writer.add_head_count(4)
    writer.add_key_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = Qwen3Config() if arch == "qwen3" else Gemma2Config()
    assert config.head_dim != 64
    _as_llama_cpp_reads(config, arch, read_fields(path))
    assert config.head_dim == 64
    assert getattr(config, "query_pre_attn_scalar", None) == expected


def test_phi3_is_trained_at_the_context_its_file_runs_at(tmp_path: Path) -> None:
    """A Phi-3 file without LongRoPE's original context is a model of its own context: not the 4096
    transformers assumes, which would send the model builder down its LongRoPE path."""
    import gguf
    from transformers import Phi3Config

    from edge_sd.export.gguf_tokenizer import read_fields
    from edge_sd.export.hf import _as_llama_cpp_reads

    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(512)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = Phi3Config(max_position_embeddings=512)
    assert config.original_max_position_embeddings == 4096
    _as_llama_cpp_reads(config, "phi3", read_fields(path))
    assert config.original_max_position_embeddings == 512


@pytest.mark.parametrize("keep", [100, 5000, -1000])
def test_a_truncated_gguf_file_is_one_line_naming_it(gguf_root: Path, tmp_path: Path, keep: int) -> None:
    """Cut in its header, in its metadata or in its tensors: one line naming the file, no output folder."""
    from typer.testing import CliRunner

    from edge_sd.tools.cli import app

    path = tmp_path / "cut.gguf"
    path.write_bytes((gguf_root / "llama.gguf").read_bytes()[:keep])
    r = CliRunner().invoke(app, ["export", "-t", str(path), "-o", str(tmp_path / "out")])
    assert r.exit_code not in (0, 1) and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.output
    assert str(path) in r.stderr.replace("\n", "") and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_a_gguf_file_computes_what_its_model_does(tmp_path: Path, arch: str) -> None:
    """Tiny models whose head size (Qwen3: 16) and query scale (Gemma-3: 32) are not what transformers
    assumes for a GGUF file, written with F32 weights and their tokenizer: exported from the file
    alone, the engine's logits over a prompt longer than Gemma's sliding window equal the model's own
    forward, and so do one-position steps on to position 200 (Gemma-3's global layer grouped, its
    writer's view moving at 64, 128 and 192)."""
    import torch
    from transformers import AutoModelForCausalLM

    from edge_sd.engines.ort import OrtEngine
    from edge_sd.export.hf import ExportOptions, export_engine

    hf = tiny.build_model(tmp_path / "hf", tiny.train_byte_level(320), arch, seed=31, steps=30)
    path = tiny.write_gguf(hf, tmp_path / f"{arch}.gguf", {}, tokenizer=True)
    (tmp_path / "engine").mkdir()
    m = export_engine(str(path), tmp_path / "engine", ExportOptions())
    assert m.grouped_attention == ([5] if arch == "gemma3" else [])
    ids = np.random.default_rng(0).integers(3, 300, size=200)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(torch.tensor(ids[None])).logits[0].numpy()
    engine = OrtEngine(tmp_path / "engine", provider="cpu", threads=2)
    out = engine.forward(ids[:24])[:, :ref.shape[1]]
    steps = np.concatenate([out] + [engine.forward(ids[i : i + 1])[:, :ref.shape[1]] for i in range(24, 200)])
    assert np.abs(steps - ref).max() < 1e-3 * np.abs(ref).max()
    assert (steps.argmax(-1) == ref.argmax(-1)).all()


def test_float_weights_of_every_width_are_carried(gguf_root: Path, tmp_path: Path) -> None:
    """F16 and BF16 weights (BF16 arrives as raw 16-bit words) stay float MatMuls with the file's
    values: the export validates against transformers' reading of the same file."""
    from edge_sd.export.hf import ExportOptions, export_engine

    path = tiny.write_gguf(gguf_root / "hf_llama", tmp_path / "floats.gguf",
                           {"*attn_q.*": "F16", "*ffn_up*": "BF16"}, tokenizer=True)
    (tmp_path / "e").mkdir()
    m = export_engine(str(path), tmp_path / "e", ExportOptions())
    q = m.quantization
    assert q["float_matmuls"] >= 4  # q and up in both layers
    assert m.validation["top1_agreement_vs_torch"] == 1.0 and m.validation["max_rel_diff_vs_torch"] < 1e-4
