"""Tiny local models for the tests: small tokenizers trained here, models trained for a few seconds.

Nothing is downloaded. Each model is trained briefly on the same small corpus, so that a target and a
drafter with different tokenizers predict similar text: acceptance is then real, not zero or one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CORPUS_SEED = 1234


def corpus() -> list[str]:
    """A deterministic mix of prose, code, unicode and whitespace runs."""
    rng = random.Random(CORPUS_SEED)
    subjects = ["The cat", "A small robot", "My friend", "The old river", "Every engineer", "The model"]
    verbs = ["runs", "reads", "writes", "sees", "builds", "decodes", "draws"]
    objects = ["a long story", "the fast code", "tokens", "a quiet song", "the map", "42 numbers"]
    lines = []
    for _ in range(300):
        lines.append(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}.")
    code = [
        "def add(a, b):\n    return a + b\n",
        "for i in range(10):\n    print(i)\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "if x == 0:\n\treturn None\nelse:\n\treturn x * 2\n",
    ]
    unicode = ["café naïve façade", "日本語のテキストです。", "emoji 🙂🚀 fun", "Ελληνικά γράμματα",
               "Привет мир", "tabs\tand  double  spaces", "   leading and trailing   "]
    for _ in range(40):
        lines.append(rng.choice(code))
        lines.append(rng.choice(unicode))
    rng.shuffle(lines)
    return lines


SPECIALS = ["<pad>", "<eos>", "<bos>"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def train_byte_level(vocab_size: int, seed_lines: int = 0):
    """A GPT-2-style byte-level BPE tokenizer (no prefix space)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus()
    tok.train_from_iterator(lines[seed_lines:] + lines[:seed_lines], trainer)
    return tok


def train_sentencepiece_style(vocab_size: int, prefix_space: bool):
    """A SentencePiece-style BPE: "▁" for spaces, <0xNN> byte fallback (Gemma style, or Llama-2 style
    with a space prefixed to every text when `prefix_space`)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix_space else "never"
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, limit_alphabet=60,
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    data = json.loads(tok.to_str())
    # Insert the 256 byte-fallback tokens right after the specials, as SentencePiece vocabularies do.
    vocab = data["model"]["vocab"]
    ordered = sorted(vocab.items(), key=lambda kv: kv[1])
    new: dict[str, int] = {}
    for piece, _ in ordered[: len(SPECIALS)]:
        new[piece] = len(new)
    for b in range(256):
        new[f"<0x{b:02X}>"] = len(new)
    for piece, _ in ordered[len(SPECIALS):]:
        new.setdefault(piece, len(new))
    data["model"]["vocab"] = new
    data["model"]["byte_fallback"] = True
    for t in data["added_tokens"]:
        t["id"] = new[t["content"]]
    tok = Tokenizer.from_str(json.dumps(data))
    tok.normalizer = normalizers.Sequence([])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix_space else []))
    return tok


def build_model(folder: Path, tokenizer, arch: str, seed: int, steps: int = 150, add_bos: bool = True,
                **config: int) -> Path:
    """Train a tiny causal LM of architecture `arch` on the corpus and save it as an HF folder
    (config: fields that replace the tiny defaults, such as hidden_size)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(seed)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    model = _make(arch, vocab, **config)
    ids: list[int] = []
    for line in corpus():
        ids += tokenizer.encode(line + "\n", add_special_tokens=False).ids
    data = torch.tensor(ids)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    seq = 48
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (8,), generator=gen)
        batch = torch.stack([data[s : s + seq] for s in starts])
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.config.bos_token_id = 2
    model.config.eos_token_id = 1
    model.config.pad_token_id = 0
    model.save_pretrained(folder)
    from tokenizers import processors

    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder


def _make(arch: str, vocab: int, **config: int):
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2,
                  bos_token_id=2, eos_token_id=1, pad_token_id=0) | config
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **common))
    if arch == "qwen3":  # 16-wide heads: not the 128 transformers assumes for a Qwen3 GGUF file
        return Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, **common))
    if arch == "gemma3":
        # The released Gemma-3 layer pattern (five sliding-window layers, then a global one), which
        # onnxruntime-genai's model builder assumes; a 16-position window that the tests exceed.
        layer_types = ["sliding_attention"] * 5 + ["full_attention"]
        return Gemma3ForCausalLM(Gemma3TextConfig(
            num_key_value_heads=1, head_dim=32, sliding_window=16, query_pre_attn_scalar=32,
            layer_types=layer_types, **{**common, "num_hidden_layers": len(layer_types)}))
    raise ValueError(arch)


def pad_vocabulary(src: Path, dest: Path, extra: int) -> Path:
    """A copy of an HF folder whose LM head is `extra` rows wider than its tokenizer (Qwen-style
    padded heads), the padding rows 1.5x copies of real ones: wherever a real token has a positive
    logit its padding twin has a larger one, so any code that lets a padding id compete picks it."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src)
    n = model.config.vocab_size
    model.resize_token_embeddings(n + extra, mean_resizing=False)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[n:] = 1.5 * head[:extra]
    model.save_pretrained(dest)
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, dest / f.name)
    return dest


# --- tiny GGUF files ------------------------------------------------------------------------------

def gguf_name(hf_name: str, arch: str = "llama", blocks: int = 64) -> str:
    """llama.cpp's name for an HF parameter (the gguf package's own table)."""
    import gguf

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), blocks)
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise KeyError(hf_name)
    return name


def quantize_q6_k(w):
    """A plain Q6_K quantizer (scales from each 16-block's largest magnitude): valid blocks close to w."""
    import numpy as np

    blocks = w.astype(np.float32).reshape(-1, 16, 16)  # [super-blocks, 16 blocks, 16 weights]
    scale = np.abs(blocks).max(axis=-1) / 31  # [n, 16]
    d = (scale.max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)  # [n, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.round(scale / d), 0).clip(-128, 127).astype(np.int8)
        step = d * sc.astype(np.float32)
        q = np.where(step[..., None] > 0, np.round(blocks / step[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    n = len(q)
    low, high = (q & 0x0F).reshape(n, 2, 2, 64), (q >> 4).reshape(n, 2, 4, 32)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.astype(np.float16).view(np.uint8)], axis=1)
    return raw.reshape(w.shape[0], -1)


def random_blocks(w, kind: str):
    """IQ4_NL blocks of random indices and small scales: a valid tensor of a type no quantizer here
    writes (for refusals, not for quality)."""
    import numpy as np

    assert kind == "IQ4_NL"
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(w.size // 32, 18), dtype=np.uint8)
    raw[:, :2] = np.full(len(raw), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(w.shape[0], -1)


def add_tokenizer(writer, tokenizer_json: Path) -> None:
    """A byte-level BPE tokenizer's metadata as llama.cpp's converter writes it (`gpt2`, GPT-2's
    pre-tokenizer; special tokens as control tokens; BOS where the tokenizer adds one)."""
    import gguf

    tj = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tj["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    writer.add_bos_token_id(vocab["<bos>"])
    writer.add_eos_token_id(vocab["<eos>"])
    writer.add_add_bos_token(bool(tj.get("post_processor")))


def write_gguf(hf: Path, path: Path, types: dict[str, str], tokenizer: bool = False) -> Path:
    """The llama, qwen2, qwen3 or gemma3 model of an HF folder as a GGUF file: each weight matrix in the GGML type of
    the first pattern of `types` (fnmatch on GGUF names) it matches, else F32; norms and biases F32.
    tokenizer: with the folder's tokenizer in the metadata, as llama.cpp's converter writes it.
    Llama's q and k rows are permuted as llama.cpp's converter permutes them (transformers undoes it)."""
    import fnmatch

    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    cfg = model.config
    arch = {"gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    writer = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_chat_template(CHAT_TEMPLATE)  # as real GGUF files carry theirs
    if tokenizer:
        add_tokenizer(writer, hf / "tokenizer.json")
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy().astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = heads if "q_proj" in name else kv_heads
            w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1  # llama.cpp's converter stores Gemma's norms as 1 + weight (transformers takes 1 off)
        gname = gguf_name(name, arch, cfg.num_hidden_layers)
        kind = next((t for p, t in types.items() if fnmatch.fnmatch(gname, p)), "F32") if w.ndim == 2 else "F32"
        if kind == "F32":
            writer.add_tensor(gname, np.ascontiguousarray(w))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            raw = quantize_q6_k(w) if kind == "Q6_K" else random_blocks(w, kind) if kind == "IQ4_NL" \
                else gguf.quants.quantize(w, qtype)
            writer.add_tensor(gname, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
