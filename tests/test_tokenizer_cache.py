"""The quicker forms of a tokenizer a loaded engine keeps (tokenizer_cache.py): every load through them
must give the tokenizer the file gives, serialized and encoding alike, and a stale, damaged, unequal
or unwritable form must only cost time."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from edge_sd import tokenizer_cache
from edge_sd.layout import QUICK_FILE, QUICK_KEY, QUICK_PARTS
from edge_sd.tokenizer_cache import quick_source, read_quick, string_merges
from edge_sd.vocab import Vocab

# Text that exercises merges, bytes beyond ASCII, whitespace runs and special tokens' spellings.
SAMPLE = ("<start_of_turn>user\nHello, world! Здравствуй, мир. 日本語のテキスト 🚀🚀\n\tdef f(x):\n"
          "        return x ** 2  # squares   <|im_start|> <s> </s>\r\n" * 3)

# A BPE whose merges join spaces, which the string form cannot hold, and fire on plain text (no
# normalizer or pre-tokenizer turns the spaces into anything else); an added token inside the
# vocabulary and one past it, special and not.
SPACED = {
    "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "pre_tokenizer": None,
    "post_processor": None, "decoder": None,
    "added_tokens": [
        {"id": 7, "content": "<s>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True},
        {"id": 8, "content": "<x>", "single_word": False, "lstrip": False, "rstrip": True, "normalized": True,
         "special": False}],
    "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
              "vocab": {"a": 0, "b": 1, " ": 2, "a ": 3, "a b": 4, "  ": 5, "   ": 6, "<s>": 7},
              "merges": [["a", " "], ["a ", "b"], [" ", " "], ["  ", " "]]},
}


def _marker(cache: Path) -> str | None:
    return json.loads((cache / QUICK_KEY).read_text(encoding="utf-8"))["copy"]


def _tokenizer_file(tmp_path: Path, name: str) -> Path:
    """A copy of a test tokenizer, or of Qwen3's with merges of space runs added at the end (tokens
    its byte-level pre-tokenizer never makes, so its encodings stay Qwen3's)."""
    from test_vocab import TOKENIZERS

    path = tmp_path / "tokenizer.json"
    if name == "spaced":
        path.write_text(json.dumps(SPACED), encoding="utf-8")
    elif name == "qwen3 spaced":
        tj = json.loads(TOKENIZERS["qwen3"].read_text(encoding="utf-8"))
        vocab = tj["model"]["vocab"]
        top = max(max(vocab.values()), *(a["id"] for a in tj["added_tokens"]))
        for i, token in enumerate([" ", "  ", "   "]):
            vocab[token] = top + 1 + i
        tj["model"]["merges"] += [[" ", " "], ["  ", " "]]
        path.write_text(json.dumps(tj), encoding="utf-8")
    else:
        shutil.copy2(TOKENIZERS[name], path)
    return path


@pytest.mark.parametrize("name, form", [("gemma3", QUICK_FILE), ("qwen3", QUICK_FILE), ("llama3", None),
                                        ("spaced", QUICK_PARTS), ("qwen3 spaced", QUICK_PARTS)])
def test_a_loaded_engine_reads_the_same_tokenizer_from_its_quick_form(name: str, form: str | None, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Merges as ["a", "b"] pairs (Gemma 3's and Qwen3's npm files) are kept as "a b" strings; where a
    part holds a space, as parts; merges that are strings already (Llama 3's) are read as they are.
    Loads from either form give the tokenizer the file gives."""
    path = _tokenizer_file(tmp_path, name)
    cache = tmp_path / "cache"
    original = Tokenizer.from_file(str(path))
    first = Vocab.from_file(path, [1], cache=cache)
    assert _marker(cache) == form
    assert (cache / QUICK_FILE).is_file() == (form == QUICK_FILE)
    assert (cache / QUICK_PARTS).is_file() == (form == QUICK_PARTS)

    def no_rewriting(*args: object) -> bool:
        raise AssertionError("made the quick form again despite a current one")

    with monkeypatch.context() as m:
        m.setattr(tokenizer_cache, "string_merges", no_rewriting)
        m.setattr(tokenizer_cache, "save_parts", no_rewriting)
        assert quick_source(path, cache) == (cache / form if form else path)
        later = Vocab.from_file(path, [1], cache=cache)
    text = SAMPLE + ("a b  a   b<s><x> a" if "spaced" in name else "")
    expected = original.encode(text).ids
    decoded = original.decode(expected, skip_special_tokens=False)
    for v in (first, later):
        assert v.tokenizer.to_str() == original.to_str()
        assert v.tokenizer.encode(text).ids == expected
        assert v.tokenizer.decode(expected, skip_special_tokens=False) == decoded
    if name == "spaced":  # the merges of spaces fire, and both added tokens are found (<x> takes the space after it)
        assert later.tokenizer.encode("a b  a   b<s><x> a").ids == [4, 5, 3, 5, 1, 7, 8, 0]


def test_parts_that_would_give_another_tokenizer_are_not_kept(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The check that keeps a parts form: one that lost an added token (here by hand) serializes
    otherwise, so the file is read as it is."""
    path = _tokenizer_file(tmp_path, "spaced")
    cache = tmp_path / "cache"
    real = tokenizer_cache.read_parts

    def lossy(parts: Path) -> Tokenizer:
        tokenizer = real(parts)
        return Tokenizer.from_str(tokenizer.to_str().replace('"rstrip":true', '"rstrip":false'))

    monkeypatch.setattr(tokenizer_cache, "read_parts", lossy)
    assert quick_source(path, cache) == path and _marker(cache) is None
    assert Vocab.from_file(path, [1], cache=cache).tokenizer.to_str() == Tokenizer.from_file(str(path)).to_str()


@pytest.mark.parametrize("name, form", [("qwen3", QUICK_FILE), ("qwen3 spaced", QUICK_PARTS)])
def test_the_quick_form_is_remade_when_stale_and_skipped_when_damaged_or_unwritable(
        name: str, form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _tokenizer_file(tmp_path, name)
    cache = tmp_path / "cache"
    expected = Tokenizer.from_file(str(path)).encode(SAMPLE).ids
    assert quick_source(path, cache) == cache / form
    # A changed file (here its modification time only) makes the form again.
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    made = []
    maker = "string_merges" if form == QUICK_FILE else "save_parts"
    real = getattr(tokenizer_cache, maker)
    with monkeypatch.context() as m:
        m.setattr(tokenizer_cache, maker, lambda *a: made.append(1) or real(*a))
        assert quick_source(path, cache) == cache / form and made == [1]
    # A damaged form: the file itself is read, and the form is made again on the next load.
    (cache / form).write_bytes(b"{ not json, not a zip")
    with pytest.raises(tokenizer_cache.ArtifactError):
        read_quick(cache / form)
    assert Vocab.from_file(path, [1], cache=cache).tokenizer.encode(SAMPLE).ids == expected
    assert not (cache / QUICK_KEY).exists()
    assert Vocab.from_file(path, [1], cache=cache).tokenizer.encode(SAMPLE).ids == expected
    assert _marker(cache) == form
    # A folder that cannot be written to: the file as it is.
    shutil.rmtree(cache)

    def unwritable(*args: object, **kwargs: object) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(tokenizer_cache, "write_aside", unwritable)
    monkeypatch.setattr(tokenizer_cache.np, "savez", unwritable)
    assert quick_source(path, cache) == path
    assert Vocab.from_file(path, [1], cache=cache).tokenizer.encode(SAMPLE).ids == expected


@pytest.mark.parametrize("merges", [[["a b", "c"]], [["a", ""]], [["a", "b", "c"]], ["a b"], []])
def test_merges_the_string_form_would_split_otherwise_stay_pairs(merges: list) -> None:
    tokenizer_json = {"model": {"type": "BPE", "merges": merges}}
    assert not string_merges(tokenizer_json)
    assert tokenizer_json["model"]["merges"] == merges
    pairs = {"model": {"type": "BPE", "merges": [["a", "b"], ["ab", "c"]]}}
    assert string_merges(pairs) and pairs["model"]["merges"] == ["a b", "ab c"]
    assert not string_merges({"model": {"type": "Unigram", "merges": [["a", "b"]]}})


@pytest.mark.real
def test_the_real_gemma_files_tokenizer_reads_from_parts(tmp_path: Path) -> None:
    """The tokenizer the real Gemma GGUF gives (its merges of space runs rule out the string form)."""
    from edge_sd.export import gguf_tokenizer
    from edge_sd.tools.paths import cache_dir

    gguf = cache_dir() / "real" / "gemma-3-270m-q4_k_m.gguf"
    if not gguf.is_file():
        pytest.fail(f"{gguf} missing: run `bash scripts/test.sh` (it fetches the real pair)")
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(gguf_tokenizer.tokenizer_json(gguf)), encoding="utf-8")
    original = Tokenizer.from_file(str(path))
    assert quick_source(path, tmp_path / "cache") == tmp_path / "cache" / QUICK_PARTS
    quick = read_quick(tmp_path / "cache" / QUICK_PARTS)
    assert quick.to_str() == original.to_str()
    assert quick.encode(SAMPLE).ids == original.encode(SAMPLE).ids
