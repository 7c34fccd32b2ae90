"""A GGUF file's own tokenizer, from its metadata, as a `tokenizers` tokenizer.json that encodes as
llama.cpp does: what a user who runs llama.cpp has is the file alone.

llama.cpp knows two kinds of vocabulary that small models carry:

- SentencePiece-style (`tokenizer.ggml.model` "llama": Llama 2, Gemma): pieces with scores, spaces
  written as "▁", bytes as `<0xNN>` pieces. llama.cpp merges, at each step, the adjacent pair whose
  joined piece is in the vocabulary with the highest score; that is byte-level-free BPE whose merges
  are every split of every piece into two pieces, ranked by the joined piece's score.
- byte-level BPE (`tokenizer.ggml.model` "gpt2": Llama 3, Qwen2, SmolLM): GPT-2's byte alphabet, the
  file's merges, and the pre-tokenizer regexes llama.cpp keeps for each `tokenizer.ggml.pre` name.

Control tokens (`<bos>`, `<|im_end|>`) are special; user-defined ones (Gemma's runs of spaces and
newlines) are matched in the raw text before anything else, as llama.cpp does. A vocabulary this
cannot reproduce is refused with a message that names it (`--tokenizer` takes a tokenizer.json instead).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_sd.errors import ExportError, UsageError

# llama.cpp's token types (llama_token_type in the GGUF).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"
# The GPT-2 regex llama.cpp splits most byte-level vocabularies with (its `gpt2` and `smollm` types).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Pre:
    """How llama.cpp pre-tokenizes one family of byte-level vocabularies: its regexes, applied in turn;
    ignore_merges: a word that is one vocabulary token is taken whole (llama.cpp's Llama 3 rule);
    add_bos: whether a BOS goes first where the file does not say."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


# `tokenizer.ggml.pre` names, as llama.cpp groups them (llama-vocab.cpp).
PRE: dict[str, Pre] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "roberta-bpe"), Pre((GPT2_REGEX,))),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva"),
                    Pre((r"\p{N}", GPT2_REGEX))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"),
                    Pre((LLAMA3_REGEX,), ignore_merges=True, add_bos=True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), Pre((QWEN2_REGEX,))),
    "smaug-bpe": Pre((LLAMA3_REGEX,)),  # Llama 3's split, without its whole-word rule or BOS
}
# Control tokens llama.cpp ends a generation at besides EOS (its end-of-generation list), by text.
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                     "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


@dataclass
class Metadata:
    """What a GGUF file says of its tokenizer."""

    model: str
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float]
    merges: list[str]
    bos: int | None
    eos: int | None
    unk: int | None
    eot: int | None
    add_bos: bool | None
    add_space_prefix: bool
    path: Path  # the file, for messages
    name: str = ""  # general.name: llama.cpp sets some token attributes by it


def read_fields(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata fields (the gguf package's ReaderFields), or an ExportError naming the file.
    Gemma's 262k tokens take seconds to parse: an export reads them once."""
    from gguf import GGUFReader

    try:
        return dict(GGUFReader(str(path)).fields)
    except Exception as e:  # the gguf package raises what numpy or struct raise on a damaged file
        raise ExportError(f"{path}: not a readable GGUF file ({e})") from None


def scalar(fields: dict[str, Any], name: str) -> Any:
    """One number or string of the metadata, or None."""
    field = fields.get(name)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode("utf-8", errors="replace") if field.types[-1].name == "STRING" else value.tolist()[0]


def read(path: Path, fields: dict[str, Any] | None = None) -> Metadata:
    """The tokenizer fields of a GGUF file (ExportError naming the file and the field where one is
    missing or of the wrong kind); `fields`: read_fields(path), where the caller has them already."""
    fields = read_fields(path) if fields is None else fields

    def get(name: str, default: Any = None, many: bool = False) -> Any:
        field = fields.get(f"tokenizer.ggml.{name}")
        if field is None:
            return default
        try:
            values = [field.parts[i] for i in field.data]
            if field.types and field.types[-1].name == "STRING":
                out = [bytes(v).decode("utf-8") for v in values]
            else:
                out = [x for v in values for x in v.tolist()]
        except (ValueError, UnicodeDecodeError, IndexError) as e:
            raise ExportError(f"{path}: tokenizer.ggml.{name} is unreadable ({e})") from None
        return out if many else (out[0] if out else default)

    tokens = get("tokens", [], many=True)
    if not tokens:
        raise UsageError(f"{path} carries no tokenizer (no tokenizer.ggml.tokens): pass --tokenizer tokenizer.json")
    types = get("token_type", [NORMAL] * len(tokens), many=True)
    scores = get("scores", [0.0] * len(tokens), many=True)
    if len(types) != len(tokens) or len(scores) != len(tokens):
        raise ExportError(f"{path}: tokenizer.ggml.token_type or .scores does not have one entry per token")
    add_bos = get("add_bos_token")
    return Metadata(
        model=get("model", ""), pre=get("pre", "default"), tokens=tokens, types=[int(t) for t in types],
        scores=[float(s) for s in scores], merges=get("merges", [], many=True), bos=get("bos_token_id"),
        eos=get("eos_token_id"), unk=get("unknown_token_id"), eot=get("eot_token_id"),
        add_bos=None if add_bos is None else bool(add_bos), add_space_prefix=bool(get("add_space_prefix", True)),
        path=Path(path), name=str(scalar(fields, "general.name") or ""),
    )


def tokenizer_json(source: Path | Metadata) -> dict:
    """The file's tokenizer as a tokenizer.json (a dict), with BOS in its post-processor where
    llama.cpp puts one in front of a prompt."""
    meta = source if isinstance(source, Metadata) else read(source)
    path = meta.path
    if meta.model == "llama":
        tok, add_bos = _sentencepiece(meta), True
    elif meta.model == "gpt2":
        pre = PRE.get(meta.pre)
        if pre is None:
            raise UsageError(f"{path}: the byte-level tokenizer's pre-tokenizer {meta.pre!r} is not one edge-sd "
                             "reproduces exactly; pass --tokenizer tokenizer.json")
        tok, add_bos = _byte_level(meta, pre), pre.add_bos
    else:
        raise UsageError(f"{path}: its tokenizer type {meta.model!r} is not one edge-sd reproduces exactly "
                         "(llama, gpt2); pass --tokenizer tokenizer.json")
    add_bos = meta.add_bos if meta.add_bos is not None else add_bos
    if add_bos and meta.bos is not None:
        from tokenizers import processors

        bos = meta.tokens[meta.bos]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, meta.bos)])
    tj = json.loads(tok.to_str())
    tj["added_tokens"] = _added_tokens(meta)
    return tj


def stop_ids(source: Path | Metadata) -> list[int]:
    """The ids llama.cpp ends a generation at: EOS, EOT and its end-of-generation control tokens."""
    meta = source if isinstance(source, Metadata) else read(source)
    ids = {i for i in (meta.eos, meta.eot) if i is not None}
    ids |= {i for i, t in enumerate(meta.tokens) if meta.types[i] == CONTROL and t in END_OF_GENERATION}
    return sorted(ids)


def _sentencepiece(meta: Metadata) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    # User-defined pieces stay as the file writes them (spaces as spaces): they are matched in the raw
    # text before the model sees it (_added_tokens), never merged from "▁" pieces.
    pieces = meta.tokens
    # The pieces' scores rank the merges. llama.cpp's converter writes one score for every piece of a
    # model that has a tokenizer.json but no tokenizer.model; llama.cpp then merges the leftmost pair
    # first, an order that no ranking of merges gives.
    ranked = [s for s, t, p in zip(meta.scores, meta.types, pieces, strict=True) if t == NORMAL and len(p) > 1]
    if len(set(ranked)) < len(ranked):
        raise UsageError(f"{meta.path}: its SentencePiece pieces share scores ({len(ranked) - len(set(ranked))} of "
                         f"{len(ranked)} repeat one), so llama.cpp merges them leftmost first, which edge-sd does "
                         "not reproduce exactly; pass --tokenizer tokenizer.json")
    vocab: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        vocab.setdefault(piece, i)
    merges = []
    for i, piece in enumerate(pieces):
        if meta.types[i] not in (NORMAL, USER_DEFINED) or vocab[piece] != i:
            continue
        splits = [(vocab[piece[:k]], vocab[piece[k:]], piece[:k], piece[k:]) for k in range(1, len(piece))
                  if piece[:k] in vocab and piece[k:] in vocab]
        merges += [(-meta.scores[i], a, b, left, right) for a, b, left, right in sorted(splits)]
    merges.sort(key=lambda m: m[0])  # stable: equal scores keep the order above
    unk = meta.tokens[meta.unk] if meta.unk is not None else None
    model = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token=unk, fuse_unk=True,
                       byte_fallback=BYTE in meta.types)
    tok = Tokenizer(model)
    # llama.cpp puts a space in front of each stretch of text that starts the input or follows a
    # special token, where the file asks for it, and writes spaces as "▁".
    steps = [normalizers.Prepend(SPM_SPACE)] if meta.add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
    decode = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*decode, decoders.Strip(" ", 1, 0)] if meta.add_space_prefix else decode)
    return tok


def _byte_level(meta: Metadata, pre: Pre) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab: dict[str, int] = {}
    for i, t in enumerate(meta.tokens):
        vocab.setdefault(t, i)
    merges = []
    for m in meta.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ExportError(f"{meta.path}: merge {m!r} of tokenizer.ggml.merges is not two tokens")
        merges.append((left, right))
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False)
    tok = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                    use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _added_tokens(meta: Metadata) -> list[dict]:
    """Control and unknown tokens as special tokens, user-defined ones as plain added tokens, each
    under its own id and as the file writes it (Gemma's runs of spaces as spaces): both are matched in
    the raw text first, longest first, as llama.cpp's special-token partition matches them."""
    # llama.cpp's rule for files named Phi-3: whitespace after a special token belongs to it, except
    # after <unk>, <s> and <|endoftext|>
    phi3 = any(n in meta.name.lower() for n in ("phi-3", "phi3"))
    out = []
    for i, (t, kind) in enumerate(zip(meta.tokens, meta.types, strict=True)):
        special = kind in (CONTROL, UNKNOWN) or i in (meta.bos, meta.eos)
        if special or kind == USER_DEFINED:
            rstrip = phi3 and t not in ("<unk>", "<s>", "<|endoftext|>")
            out.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": rstrip,
                        "normalized": False, "special": special})
    return out
