"""A GGUF file's own tokenizer (export/gguf_tokenizer.py): built from the metadata alone, it encodes
as the tokenizer the file was made from; a vocabulary it cannot reproduce is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from edge_sd.errors import UsageError
from edge_sd.export import gguf_tokenizer

import tiny
from conftest import LLAMA_TYPES

TEXTS = ["Once upon a time", "The three primary colors are", "a  b\n\n\nc    d\t\te",
         "def f(x):\n    return x ** 2  # square\n", "Prices rose 12.5% in 2024, to $1,234.56.",
         "emoji 😀🎉 and CJK 漢字かな 한국어", "  leading spaces", "trailing   ", "I'm sure they'll've done it",
         "<bos>inside<eos> specials", "über naïve café", "12345678901234567890", "tab\tsep\tvalues\n", "\n\n\n\nend"]


@pytest.fixture(scope="module")
def tokenized_gguf(gguf_root: Path) -> Path:
    """The tiny Llama's GGUF file, its tokenizer in the metadata (gpt2, GPT-2's pre-tokenizer)."""
    return gguf_root / "llama.gguf"


def encode(tok: Tokenizer, text: str, special: bool = False) -> list[int]:
    return tok.encode(text, add_special_tokens=special).ids


def test_byte_level_metadata_encodes_as_the_tokenizer_it_came_from(tokenized_gguf: Path, gguf_root: Path) -> None:
    built = Tokenizer.from_str(json.dumps(gguf_tokenizer.tokenizer_json(tokenized_gguf)))
    source = Tokenizer.from_file(str(gguf_root / "hf_llama" / "tokenizer.json"))
    for text in TEXTS:
        assert encode(built, text) == encode(source, text), text
        assert encode(built, text, special=True) == encode(source, text, special=True), text
        assert built.decode(encode(built, text), skip_special_tokens=False) == source.decode(encode(source, text),
                                                                                            skip_special_tokens=False)
    assert gguf_tokenizer.stop_ids(tokenized_gguf) == [source.token_to_id("<eos>")]


def test_a_pre_tokenizer_that_differs_would_be_caught(tokenized_gguf: Path, gguf_root: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: SmolLM's rules (digits split one by one) on the same file encode numbers
    otherwise, so the comparison above can fail."""
    monkeypatch.setitem(gguf_tokenizer.PRE, "gpt-2", gguf_tokenizer.PRE["smollm"])
    built = Tokenizer.from_str(json.dumps(gguf_tokenizer.tokenizer_json(tokenized_gguf)))
    source = Tokenizer.from_file(str(gguf_root / "hf_llama" / "tokenizer.json"))
    assert any(encode(built, t) != encode(source, t) for t in TEXTS)


def test_what_cannot_be_reproduced_is_refused_by_name(tokenized_gguf: Path, gguf_root: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    meta = gguf_tokenizer.read(tokenized_gguf)
    for field, value, words in (("pre", "made-up-pre", "'made-up-pre'"), ("model", "bert", "'bert'")):
        monkeypatch.setattr(gguf_tokenizer, "read", lambda path, f=field, v=value: type(meta)(
            **{**meta.__dict__, f: v}))
        with pytest.raises(UsageError, match=words) as e:
            gguf_tokenizer.tokenizer_json(tokenized_gguf)
        assert "--tokenizer" in str(e.value)
    # SentencePiece pieces all of one score (llama.cpp's converter on a tokenizer.json-only Llama): it
    # merges leftmost first there; the same pieces ranked by score are accepted
    tied, ranked = [-1000.0] * len(meta.tokens), [-float(i) for i in range(len(meta.tokens))]
    for scores, refused in ((tied, True), (ranked, False)):
        monkeypatch.setattr(gguf_tokenizer, "read", lambda path, s=scores: type(meta)(
            **{**meta.__dict__, "model": "llama", "scores": s}))
        if refused:
            with pytest.raises(UsageError, match="share scores.*--tokenizer"):
                gguf_tokenizer.tokenizer_json(tokenized_gguf)
        else:
            gguf_tokenizer.tokenizer_json(tokenized_gguf)
    monkeypatch.undo()
    bare = tiny.write_gguf(gguf_root / "hf_llama", tmp_path / "bare.gguf", LLAMA_TYPES)  # no tokenizer in it
    with pytest.raises(UsageError, match="no tokenizer"):
        gguf_tokenizer.tokenizer_json(bare)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tokenized_gguf.read_bytes()[:4000])
    with pytest.raises(Exception, match="broken.gguf"):
        gguf_tokenizer.tokenizer_json(broken)


@pytest.mark.slow
def test_one_gguf_file_exports_alone(tokenized_gguf: Path, gguf_root: Path, tmp_path: Path) -> None:
    """No --tokenizer: the engine encodes as the tokenizer the file was made from, with its BOS and its
    end of text (from the metadata alone), and decodes as the export given that tokenizer.json does."""
    from edge_sd import GenerationConfig, Pipeline
    from edge_sd.export.hf import ExportOptions
    from edge_sd.export.pair import export

    export(str(tokenized_gguf), None, tmp_path / "alone", ExportOptions())
    alone, given = (Pipeline.from_folder(f, provider="cpu", threads=2) for f in (tmp_path / "alone",
                                                                                  gguf_root / "pair" / "target"))
    source = Tokenizer.from_file(str(gguf_root / "hf_llama" / "tokenizer.json"))
    m = alone.target.manifest
    assert (m.bos_token_id, m.add_bos, m.eos_token_ids) == (source.token_to_id("<bos>"), True,
                                                            [source.token_to_id("<eos>")])
    assert m.exporter["tokenizer"] == "the GGUF file's metadata"  # what `inspect` shows
    for text in TEXTS:
        assert alone.target.vocab.encode_text(text) == encode(source, text), text
    cfg = GenerationConfig(max_new_tokens=12, algorithm="plain")
    for prompt in ("The cat", "Once upon a time"):
        ids = alone.target.prompt_ids(prompt, chat=False)
        a, g = alone.generator(cfg), given.generator(cfg)
        for gen in (a, g):
            gen.append_tokens(ids)
            while not gen.is_done:
                gen.generate_next_tokens()
        assert a.result().token_ids == g.result().token_ids and a.result().text == g.result().text


# llama.cpp's own ids for TEXTS on the real files (its llama-tokenize, recorded with the tool named
# in the file); benchmarks/gguf_tokenizer.py compares the prompt sets too.
LLAMA_TOKENIZE = json.loads((Path(__file__).parent / "data" / "llama_tokenize.json").read_text(encoding="utf-8"))


@pytest.mark.real
@pytest.mark.parametrize("name", sorted(LLAMA_TOKENIZE["ids"]))
def test_the_real_files_encode_as_llama_cpp_does(name: str) -> None:
    """The real pair's GGUF files alone give llama.cpp's ids; Gemma's also those of the tokenizer.json
    used with it, on the benchmarks' prompt sets. (SmolLM2's tokenizer.json, converted by transformers,
    parts from llama.cpp on code with blank lines: benchmarks/results/gguf_tokenizer.md.)"""
    from edge_sd.tools import prompt_sets
    from edge_sd.tools.paths import cache_dir

    gguf = cache_dir() / "real" / name
    if not gguf.is_file():
        pytest.fail(f"{gguf} missing: run `bash scripts/test.sh` (it fetches the real pair)")
    built = Tokenizer.from_str(json.dumps(gguf_tokenizer.tokenizer_json(gguf)))
    assert [encode(built, t) for t in TEXTS] == LLAMA_TOKENIZE["ids"][name]
    if name.startswith("gemma"):
        source = Tokenizer.from_file(str(cache_dir() / "tokenizers" / "gemma3" / "tokenizer.json"))
        texts = [p.text for s in prompt_sets.SETS for p in prompt_sets.load(s, cache_dir(), 20)]
        assert [t[:40] for t in texts if encode(built, t) != encode(source, t)] == []


def test_phi3_files_strip_whitespace_after_special_tokens(tokenized_gguf: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp's rule for files named Phi-3: the whitespace after a special token goes with it
    (but not after <s>, <unk> or <|endoftext|>); other files keep it."""
    meta = gguf_tokenizer.read(tokenized_gguf)
    plain = Tokenizer.from_str(json.dumps(gguf_tokenizer.tokenizer_json(meta)))
    phi3 = Tokenizer.from_str(json.dumps(gguf_tokenizer.tokenizer_json(type(meta)(**{**meta.__dict__,
                                                                                   "name": "Phi-3-mini"}))))
    assert encode(phi3, "a<eos>  \n b") == encode(phi3, "a<eos>b") != encode(plain, "a<eos>  \n b")
    assert encode(plain, "a<eos>  \n b") != encode(plain, "a<eos>b")
