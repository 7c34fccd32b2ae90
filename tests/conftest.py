"""Session fixtures: tiny tokenizers and models built locally, exported once per test session."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

# Where the pairs run: cpu here and in CI; EDGE_SD_TEST_PROVIDER=cuda runs the same lossless tests
# through the CUDA provider on a machine with a GPU, the builder's engines exported for it (fp16,
# --device cuda: a builder graph made for the CPU runs on the CPU only). The pruned pairs' kernels run
# those engines, so that cache is built where CUDA is (with the export extra).
PROVIDER = os.environ.get("EDGE_SD_TEST_PROVIDER", "cpu")

# name -> (tokenizer kind, architecture, seed, training steps)
MODELS = {
    "sp_gemma": ("sp", "gemma3", 0, 150),
    "bl_llama": ("bl", "llama", 1, 150),
    "bl2_qwen": ("bl2", "qwen2", 2, 150),
    "sp2_llama": ("sp2", "llama", 3, 150),
    "bl_llama_b": ("bl", "llama", 4, 60),
    "bl2_random": ("bl2", "qwen2", 5, 0),  # untrained: a drafter that knows nothing
}
# Engines exported through `--exporter auto` (onnxruntime-genai's model builder for these three
# architectures: GroupQueryAttention, a shared KV buffer); these also go through optimum (concat KV
# layout), so that both layouts run every test that takes a pair.
OPTIMUM_ENGINES = {"sp_gemma_opt": "sp_gemma", "bl2_qwen_opt": "bl2_qwen", "bl_llama_opt": "bl_llama"}
# Copies with an LM head wider than the tokenizer (tiny.pad_vocabulary): the padding ids must never
# be emitted nor drafted, and the output must be the unpadded model's.
PADDED = {"bl_llama_padded": "bl_llama", "bl2_qwen_padded": "bl2_qwen"}
# pair name -> (target, drafter)
PAIRS = {
    "gemma_qwen": ("sp_gemma", "bl2_qwen"),  # SentencePiece-style target, byte-level drafter
    "llama_sp2": ("bl_llama", "sp2_llama"),  # byte-level target, SentencePiece-style drafter
    "gemma_sp2": ("sp_gemma", "sp2_llama"),  # two SentencePiece styles (one adds a prefix space)
    "llama_qwen": ("bl_llama", "bl2_qwen"),  # two byte-level vocabularies
    "llama_same": ("bl_llama", "bl_llama_b"),  # one vocabulary: standard speculative sampling
    "llama_self": ("bl_llama", "bl_llama"),  # the drafter is the target itself
    "llama_random": ("bl_llama", "bl2_random"),  # an untrained drafter
    "gemma_qwen_opt": ("sp_gemma_opt", "bl2_qwen_opt"),  # optimum's graphs on both sides
    "llama_qwen_mixed": ("bl_llama_opt", "bl2_qwen"),  # an optimum target, a builder drafter
    "padded": ("bl_llama_padded", "bl2_qwen_padded"),  # padded LM heads on both sides
}
# Pairs whose drafter's LM head is pruned to a fraction of its vocabulary, with RDK's kernel (built from
# the tiny corpus): pair name -> (pair it copies, kept fraction). 1.0 builds the kernel, prunes nothing.
PRUNED = {
    "gemma_qwen_keep50": ("gemma_qwen", 0.5),  # builder graphs: a MatMul head
    "gemma_qwen_opt_keep50": ("gemma_qwen_opt", 0.5),  # optimum, tied: a Transpose of the embedding
    "llama_sp2_keep25": ("llama_sp2", 0.25),
    "llama_qwen_keep100": ("llama_qwen", 1.0),
}
CROSS_PAIRS = ("gemma_qwen", "llama_sp2", "gemma_sp2", "llama_qwen", "gemma_qwen_opt", "llama_qwen_mixed")


def _tokenizer(kind: str):
    if kind == "bl":
        return tiny.train_byte_level(512)
    if kind == "bl2":
        return tiny.train_byte_level(384, seed_lines=50)
    if kind == "sp":
        return tiny.train_sentencepiece_style(600, prefix_space=False)
    return tiny.train_sentencepiece_style(450, prefix_space=True)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """HF folders and exported engines of every tiny model, and the pair folders.

    EDGE_SD_TEST_CACHE keeps them between runs (handy locally; CI builds them fresh).
    """
    from edge_sd.export.hf import ExportOptions, export_engine
    from edge_sd.export.pair import write_pair
    from edge_sd.export.prune import prune_pair
    from edge_sd.manifest import load_engine_manifest

    cache = os.environ.get("EDGE_SD_TEST_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("tiny")
    if PROVIDER != "cpu":  # engines of their own, beside the CPU's
        root = root / f"for-{PROVIDER}"
    if (root / "done").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    for name, (kind, arch, seed, steps) in MODELS.items():
        hf = root / "hf" / name
        if not hf.exists():
            tiny.build_model(hf, _tokenizer(kind), arch, seed, steps)
    for name, src in PADDED.items():
        if not (root / "hf" / name).exists():
            tiny.pad_vocabulary(root / "hf" / src, root / "hf" / name, extra=40)
    engines = {name: (name, "auto") for name in [*MODELS, *PADDED]}
    engines |= {e: (m, "optimum") for e, m in OPTIMUM_ENGINES.items()}
    for name, (model, exporter) in engines.items():
        eng = root / "engines" / name
        if not eng.exists():
            tmp = root / "engines" / f".{name}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            gpu = {"precision": "fp16", "device": "cuda"} if PROVIDER != "cpu" and exporter != "optimum" else {}
            export_engine(str(root / "hf" / model), tmp, ExportOptions(exporter=exporter, **gpu), name=name)
            tmp.rename(eng)
    for pair, (t, d) in PAIRS.items():
        folder = root / "pairs" / pair
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        shutil.copytree(root / "engines" / t, folder / "target")
        shutil.copytree(root / "engines" / d, folder / "drafter")
        write_pair(folder, load_engine_manifest(folder / "target"), load_engine_manifest(folder / "drafter"))
    for pair, (src, fraction) in PRUNED.items():
        folder = root / "pairs" / pair
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(root / "pairs" / src, folder)
        prune_pair(folder, fraction, ["\n".join(tiny.corpus())])
    (root / "done").touch()
    return root


@pytest.fixture(scope="session")
def pipelines(tiny_root: Path):
    """Loaded Pipeline of every pair (2 threads: the CI machine's cores)."""
    from edge_sd import Pipeline

    return {name: Pipeline.from_folder(tiny_root / "pairs" / name, provider=PROVIDER, threads=2)
            for name in [*PAIRS, *PRUNED]}


# --- GGUF files of tiny models (precision gguf) ----------------------------------------------------

# Dimensions: K-quants need rows that are multiples of 256; no dimension equals the vocabulary size
# (the model builder confuses an MLP as wide as the vocabulary with the LM head).
# A context long enough for the benchmark prompt sets (the README's quick start calibrates on them).
DIMS = {"hidden_size": 256, "intermediate_size": 768, "max_position_embeddings": 2048}
# A fused q/k/v of three storages (8-bit blocks of 32 with zero points 16 and 128, 8-bit blocks of 16),
# 4-bit blocks, offsets in 4 and 8 bits, and an untied output; the tied model's embedding has offsets.
LLAMA_TYPES = {"*attn_q.*": "Q5_0", "*attn_k.*": "Q6_K", "*attn_v.*": "Q8_0", "*attn_output*": "Q4_0",
               "*ffn_gate*": "Q4_1", "*ffn_up*": "Q5_1", "*ffn_down*": "Q6_K", "token_embd*": "Q8_0",
               "output.weight": "Q8_0"}
QWEN_TYPES = {"*attn_q.*": "Q4_0", "*attn_k.*": "Q4_0", "*attn_v.*": "Q6_K", "*attn_output*": "Q8_0",
              "*ffn_gate*": "Q5_0", "*ffn_up*": "Q5_0", "*ffn_down*": "Q4_1", "token_embd*": "Q4_1"}


@pytest.fixture(scope="session")
def gguf_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GGUF files of a tiny Llama (target) and Qwen2 (drafter), and their pair exported as gguf."""
    from edge_sd.export.hf import ExportOptions
    from edge_sd.export.pair import export

    cache = os.environ.get("EDGE_SD_TEST_CACHE")
    root = Path(cache) / "gguf" if cache else tmp_path_factory.mktemp("gguf")
    if (root / "done").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name, arch, tok, types, seed in (("llama", "llama", tiny.train_byte_level(512), LLAMA_TYPES, 21),
                                         ("qwen", "qwen2", tiny.train_byte_level(384, seed_lines=50), QWEN_TYPES, 22)):
        hf = tiny.build_model(root / f"hf_{name}", tok, arch, seed=seed, steps=100, **DIMS)
        tok.save(str(root / f"{name}.tokenizer.json"))
        tiny.write_gguf(hf, root / f"{name}.gguf", types, tokenizer=True)
    export(str(root / "llama.gguf"), str(root / "qwen.gguf"), root / "pair", ExportOptions(),
           tokenizer=str(root / "llama.tokenizer.json"), drafter_tokenizer=str(root / "qwen.tokenizer.json"))
    (root / "done").touch()
    return root
