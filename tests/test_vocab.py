"""Token bytes and vocabulary maps on the real tokenizers that scripts/setup.sh installs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_sd.token_bytes import utf8_complete
from edge_sd.tools.paths import cache_dir
from edge_sd.vocab import Vocab
from edge_sd.vocab_maps import build_maps, same_vocabulary

CACHE = cache_dir()
TOKENIZERS = {
    "gemma3": CACHE / "tokenizers" / "gemma3" / "tokenizer.json",
    "llama3": CACHE / "tokenizers" / "llama3" / "tokenizer.json",
    "qwen3": CACHE / "tokenizers" / "qwen3" / "tokenizer.json",
    "gpt4o": CACHE / "tokenizers" / "gpt4o" / "tokenizer.json",
    "mistral": CACHE / "tokenizers" / "llama2" / "tokenizer.json",  # the package holds Mistral-7B's
    "smollm2": CACHE / "real" / "smollm2-tokenizer" / "tokenizer.json",
}
_loaded: dict[str, Vocab] = {}


def vocab(name: str) -> Vocab:
    path = TOKENIZERS[name]
    # Installed by scripts/setup.sh, which the test command runs first: missing means a broken set-up.
    assert path.is_file(), f"{path} missing: run scripts/setup.sh"
    if name not in _loaded:
        _loaded[name] = Vocab.from_file(path)
    return _loaded[name]


PIECES = ["Hello", " world", "日本語", "中文字符", "🙂", "🚀🚀", "  ", "\t", "\n\n", "def f(x):", "    return x",
          "café", "naïve", "Ελληνικά", "Привет", "0.5e-3", "<div>", "   ", "ø", "\u200b", "x"]
texts = st.lists(st.sampled_from(PIECES) | st.text(min_size=1, max_size=6), min_size=1, max_size=8).map("".join)


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_token_bytes_equal_the_tokenizers_decoding(name: str, text: str) -> None:
    v = vocab(name)
    ids = v.encode_text(text)
    if any(v.token_bytes[i] is None for i in ids):
        return  # an unknown token: the tokenizer has no spelling of this text to compare with
    got = v.ids_bytes(ids)
    decoded = v.tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8")
    if v.adds_prefix_space and got.startswith(b" "):
        got = got[1:]  # the decoder strips the space that the encoder added in front of the text
    assert got == decoded


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(text=texts)
def test_encode_bytes_is_exact_continuation(name: str, text: str) -> None:
    v = vocab(name)
    data = text.encode("utf-8")
    ids = v.encode_bytes(data)
    if ids is None:
        # Only where the tokenizer itself cannot spell the text: SmolLM2 lacks some lead bytes and maps
        # them to its unknown token, and normalizers rewrite some characters (Qwen3's NFC turns the
        # compatibility ideograph U+F900 into U+8C48).
        assert v.ids_bytes(v.encode_text(text)) != data
    else:
        assert v.ids_bytes(ids) == data


def test_special_tokens_have_no_bytes() -> None:
    g = vocab("gemma3")
    for tok in ("<bos>", "<eos>", "<start_of_turn>"):
        assert g.token_bytes[g.tokenizer.token_to_id(tok)] is None
    assert g.token_bytes[g.tokenizer.token_to_id("<0xE6>")] == b"\xe6"
    assert g.token_bytes[g.tokenizer.token_to_id("\u2581the")] == b" the"


def test_utf8_complete() -> None:
    s = "a日🙂".encode()
    assert [len(utf8_complete(s[:i])) for i in range(len(s) + 1)] == [0, 1, 1, 1, 4, 4, 4, 4, 8]


PAIRS = [("gemma3", "smollm2"), ("gemma3", "llama3"), ("llama3", "qwen3"), ("qwen3", "gpt4o"),
         ("mistral", "smollm2"), ("gemma3", "mistral"), ("llama3", "smollm2")]


@pytest.mark.parametrize("target,drafter", PAIRS)
def test_intersection_and_prefix_maps(target: str, drafter: str) -> None:
    t, d = vocab(target), vocab(drafter)
    maps = build_maps(d, t)
    inter = maps.intersection
    shared = int((inter >= 0).sum())
    mapped = int((maps.prefix >= 0).sum())
    print(f"{target} <- {drafter}: intersection {shared}/{d.size}, prefix-mapped {mapped}/{d.size}")
    assert shared > 0.3 * d.size
    for di in range(0, d.size, 97):
        b = d.token_bytes[di]
        if inter[di] >= 0 and b:
            assert t.token_bytes[inter[di]] == b
        if maps.prefix[di] >= 0 and b:
            assert b.startswith(t.token_bytes[maps.prefix[di]])
    # Every drafter token with bytes has a prefix in a byte-complete target (byte fallback/byte-level).
    with_bytes = sum(1 for b in d.token_bytes if b)
    assert mapped >= with_bytes
    assert not same_vocabulary(t, d)


def test_same_vocabulary_with_itself() -> None:
    assert same_vocabulary(vocab("qwen3"), Vocab.from_file(TOKENIZERS["qwen3"]))
