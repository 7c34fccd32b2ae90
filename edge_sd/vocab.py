"""A tokenizer with the byte string of every id (token_bytes.py spells them), read quickly from what a
loaded engine keeps in its runtime cache.

Text is handled as bytes everywhere in the loop (docs/algorithms.md, "Lossless, precisely"): a drafter
token can end in the middle of a UTF-8 character, so nothing here decodes partial bytes to `str` and
back. The maps between two vocabularies are in vocab_maps.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edge_sd.errors import ArtifactError
from edge_sd.layout import TABLES_FILE
from edge_sd.token_bytes import Tables
from edge_sd.tokenizer_cache import read_tokenizer

# How many committed tokens of context a re-tokenization window keeps on its left, so that merges
# across the window's left edge come out as they would in the full text.
WINDOW_TOKENS = 6
# The layout's version of Vocab's tables as a loaded engine keeps them (Tables, TABLES_FILE).
TABLES_FORMAT = 1


class Vocab:
    """A tokenizer plus the byte string of every id (None for special tokens)."""

    def __init__(self, tokenizer: Tokenizer, tokenizer_json: dict | None, eos_ids: list[int] | None = None,
                 tables: Tables | None = None):
        """tokenizer_json: the file's parts Vocab reads (None: described from the tokenizer); not read
        when `tables` (built from them earlier) are given."""
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids or [])
        if tables is None:
            tables = Tables.build(tokenizer, tokenizer_json or _described(tokenizer), self.eos_ids)
        self.tables = tables
        # An id for every token (asking the tokenizer costs a tenth of a second for 262k of them).
        self.size = len(tables.token_bytes)
        self.style = tables.style
        self.special_ids = tables.special_ids
        self.token_bytes = tables.token_bytes
        self.byte_fallback_ids = tables.byte_fallback_ids
        self.single_byte: dict[int, int] = {}
        for i in tables.one_byte_ids():
            b = self.token_bytes[i][0]  # type: ignore[index]
            if b not in self.single_byte or i in self.byte_fallback_ids:
                self.single_byte[b] = i
        # One space-prefix probe for the encoders that add a leading "▁" to every text (Llama-2).
        probe = tokenizer.encode("a", add_special_tokens=False).ids
        self.adds_prefix_space = self.ids_bytes(probe) == b" a"
        self._starting_with: dict[bytes, np.ndarray] = {}

    @functools.cached_property
    def by_bytes(self) -> dict[bytes, int]:
        """Byte string -> id, preferring the token the tokenizer itself produces over a byte-fallback
        twin ("▁" over <0x20>)."""
        table: dict[bytes, int] = {}
        for t, b in enumerate(self.token_bytes):
            if b and (b not in table or table[b] in self.byte_fallback_ids):
                table[b] = t
        return table

    def ids_starting_with(self, prefix: bytes) -> np.ndarray:
        """The ids whose bytes begin with `prefix` (remembered per prefix: prompts often end alike)."""
        if prefix not in self._starting_with:
            self._starting_with[prefix] = np.asarray(
                [t for t, b in enumerate(self.token_bytes) if b and b.startswith(prefix)], dtype=np.int64)
        return self._starting_with[prefix]

    @functools.cached_property
    def max_token_len(self) -> int:
        return max((len(b) for b in self.by_bytes), default=0)

    @classmethod
    def from_file(cls, path: Path, eos_ids: list[int] | None = None, cache: Path | None = None) -> Vocab:
        """cache: a folder to keep the spelled tables in (TABLES_FILE), read instead of spelling them
        again while the tokenizer file and the EOS ids are unchanged, and the tokenizer's quicker form
        (tokenizer_cache.py); None: spell them, and read the file as it is."""
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"tokenizer file {path} not found")
        tok = read_tokenizer(path, cache)
        if cache is None:
            return cls(tok, None, eos_ids)
        stat = path.stat()
        key = {"format": TABLES_FORMAT, "tokenizer": [path.name, stat.st_size, stat.st_mtime_ns],
               "eos": list(eos_ids or [])}
        tables = Tables.load(cache / TABLES_FILE, key)
        vocab = cls(tok, None, eos_ids, tables)
        if tables is None:
            try:
                cache.mkdir(parents=True, exist_ok=True)
                vocab.tables.save(cache / TABLES_FILE, key)
            except OSError:
                pass  # a read-only folder: spelled again on the next load
        return vocab

    def ids_bytes(self, ids: list[int] | np.ndarray) -> bytes:
        """Concatenated bytes of token ids; special tokens contribute nothing."""
        tb = self.token_bytes
        return b"".join(tb[i] or b"" for i in ids)

    def encode_text(self, text: str) -> list[int]:
        """Ids for plain text, no special tokens added (the caller adds BOS from the manifest)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_bytes(self, data: bytes) -> list[int] | None:
        """Ids whose bytes are exactly `data` (a continuation, so no added prefix space), or None.

        `data` must not end inside a UTF-8 character. Invalid UTF-8 inside it (models can emit stray
        bytes) is spelled with single-byte tokens where the vocabulary has them. Tokenizers that
        prefix every text with a space are handled by encoding after a newline and dropping the
        tokens that cover it.
        """
        if not data:
            return []
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            left = self.encode_bytes(data[: e.start])
            mid = [self.single_byte.get(b, -1) for b in data[e.start : e.end]]
            right = self.encode_bytes(data[e.end :])
            if left is None or right is None or -1 in mid:
                return None
            return left + mid + right
        ids = self.encode_text(text)
        got = self.ids_bytes(ids)
        if got == data:
            return ids
        if got == b" " + data and ids and self.token_bytes[ids[0]] == b" ":
            return ids[1:]
        ids = self.encode_text("\n" + text)
        cut = _boundary(self, ids, len(self.ids_bytes(ids)) - len(data))
        if cut is not None and self.ids_bytes(ids[cut:]) == data:
            return ids[cut:]
        return None


def _boundary(vocab: Vocab, ids: list[int], offset: int) -> int | None:
    """Index of the first token that starts exactly at byte `offset`, or None."""
    pos = 0
    for j, t in enumerate(ids):
        if pos == offset:
            return j
        pos += len(vocab.token_bytes[t] or b"")
    return None


def _described(tok: Tokenizer) -> dict:
    """The parts of a tokenizer.json that Vocab reads, from the loaded tokenizer itself: parsing the
    file again in Python costs a second and hundreds of MB for a 262k vocabulary, nearly all of it the
    merges, which Vocab does not read."""
    def state(part: object) -> dict | None:
        return json.loads(part.__getstate__()) if part is not None else None  # type: ignore[attr-defined]

    model = {"type": type(tok.model).__name__, "byte_fallback": bool(getattr(tok.model, "byte_fallback", False)),
             "vocab": tok.get_vocab(with_added_tokens=False)}
    added = [{"id": i, "content": t.content, "special": t.special} for i, t in tok.get_added_tokens_decoder().items()]
    return {"model": model, "added_tokens": added, "pre_tokenizer": state(tok.pre_tokenizer),
            "decoder": state(tok.decoder)}


