"""Token bytes for any `tokenizer.json`, and the maps that bridge two vocabularies.

Text is handled as bytes everywhere in the loop (docs/algorithms.md, "Lossless, precisely"): a drafter token can end
in the middle of a UTF-8 character, so nothing here decodes partial bytes to `str` and back.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from edge_sd.errors import ArtifactError
from edge_sd.layout import QUICK_FILE, QUICK_KEY, TABLES_FILE
from edge_sd.manifest import write_aside

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space
# How many committed tokens of context a re-tokenization window keeps on its left, so that merges
# across the window's left edge come out as they would in the full text.
WINDOW_TOKENS = 6
# The layout's versions of Vocab's tables as a loaded engine keeps them (Tables, TABLES_FILE) and of
# the tokenizer.json a loaded engine reads instead of its own (quick_source, QUICK_FILE and QUICK_KEY).
TABLES_FORMAT = 1
QUICK_FORMAT = 1


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the operating system (glibc only; elsewhere nothing).

    Reading a tokenizer.json parses it whole before building the tokenizer: for a 262k vocabulary
    about 200 MB, freed at once but kept by glibc's allocator, where it would stay resident for the
    process's life."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # no C library to ask (Windows), or not glibc
        return
    trim(0)


def string_merges(tokenizer_json: dict) -> bool:
    """Rewrite a BPE model's merges from ["a", "b"] pairs to "a b" strings, in place, where that is the
    same list (no part empty or holding a space, which the string form splits on); whether it did."""
    model = tokenizer_json.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return False
    merges = model.get("merges")
    if not isinstance(merges, list) or not merges:
        return False
    for m in merges:
        if not (isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) and p and " " not in p for p in m)):
            return False
    model["merges"] = [f"{a} {b}" for a, b in merges]
    return True


def quick_source(path: Path, cache: Path) -> Path:
    """The file to read `path`'s tokenizer from: a copy in `cache` whose BPE merges are "a b" strings
    where `path` has ["a", "b"] pairs (string_merges), else `path` itself.

    `tokenizers` reads both forms into the same merges, but a pair goes through serde's untagged
    buffering first: for a vocabulary of hundreds of thousands of merges the string form reads
    markedly faster and with a fraction of the transient heap (figures in benchmarks/results/
    startup.md), and that transient is what a loading process peaks on. The copy is made on the
    first load, and again whenever the file's name, size or modification time change; a folder that
    cannot be written to is read as it is."""
    stat = path.stat()
    key = {"format": QUICK_FORMAT, "tokenizer": [path.name, stat.st_size, stat.st_mtime_ns]}
    copy, marker = cache / QUICK_FILE, cache / QUICK_KEY
    try:
        saved = json.loads(marker.read_text(encoding="utf-8"))
        if saved["key"] == key:
            return copy if saved["copy"] and copy.is_file() else path
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return path  # reading it as it is reports what is wrong
    made = isinstance(tokenizer_json, dict) and string_merges(tokenizer_json)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if made:
            write_aside(copy, json.dumps(tokenizer_json, separators=(",", ":")))
        write_aside(marker, json.dumps({"key": key, "copy": made}) + "\n")
    except OSError:
        return path
    return copy if made else path


def _read_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ArtifactError(f"{path}: not a valid tokenizer.json ({e})") from None


def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-to-unicode table, inverted: printable bytes map to themselves, the rest to 256+.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


BYTE_DECODER = _byte_decoder()


def _has_type(node: object, name: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence) contains a part of type `name`."""
    if isinstance(node, dict):
        if node.get("type") == name:
            return True
        return any(_has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, name) for v in node)
    return False


def _utf8_complete_end(data: bytes) -> int:
    """Length of the longest prefix of `data` that does not end inside a UTF-8 character."""
    n = len(data)
    i = n - 1
    # Walk back over at most 3 continuation bytes to the lead byte of the last character.
    while i >= 0 and n - i <= 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0:
        return 0
    lead = data[i]
    need = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    return n if n - i >= need else i


def is_continuation(data: bytes) -> bool:
    """Whether `data` starts inside a UTF-8 character (with a continuation byte 10xxxxxx)."""
    return bool(data) and (data[0] & 0xC0) == 0x80


def utf8_complete(data: bytes) -> bytes:
    """`data` cut after its last complete UTF-8 character."""
    return data[: _utf8_complete_end(data)]


@dataclass
class Tables:
    """What Vocab reads from a tokenizer.json: its style, special ids, byte-fallback ids and the byte
    string of every id (None for special tokens and EOS). Spelling 262k tokens takes about a second,
    so a loaded engine keeps these beside it (`save`/`load`, in its runtime_cache)."""

    style: str
    special_ids: set[int]
    token_bytes: list[bytes | None]
    byte_fallback_ids: set[int]
    _lengths: np.ndarray | None = field(default=None, repr=False, compare=False)  # as saved: -1 for None

    @classmethod
    def build(cls, tokenizer: Tokenizer, tokenizer_json: dict, eos_ids: list[int]) -> Tables:
        style = _style(tokenizer_json)
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        special_ids = {t["id"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
        model = tokenizer_json.get("model", {})
        byte_fallback = bool(model.get("byte_fallback"))
        added = {t["id"]: t for t in tokenizer_json.get("added_tokens", [])}
        token_bytes: list[bytes | None] = []
        byte_fallback_ids: set[int] = set()
        # id -> piece as the tokenizer's id_to_token gives it (added tokens first), read from the
        # tables in one pass rather than 262k calls into the tokenizer.
        pieces: dict[int, str] = {i: piece for piece, i in model.get("vocab", {}).items()}
        pieces.update((t["id"], t["content"]) for t in tokenizer_json.get("added_tokens", []))
        for i in range(size):
            if i in special_ids or i in eos_ids:
                token_bytes.append(None)
                continue
            piece = pieces[i] if i in pieces else tokenizer.id_to_token(i)
            if piece is None:
                token_bytes.append(None)
            elif i in added and not added[i].get("special") and piece not in model.get("vocab", {}):
                # Added (non-special) tokens are stored as plain text, not in the model's alphabet.
                token_bytes.append(piece.encode("utf-8") or None)
            else:
                token_bytes.append(_piece_bytes(piece, style, byte_fallback))
                if byte_fallback and _BYTE_FALLBACK.match(piece):
                    byte_fallback_ids.add(i)
        return cls(style, special_ids, token_bytes, byte_fallback_ids)

    def one_byte_ids(self) -> list[int]:
        """The ids whose bytes are a single byte, ascending."""
        return np.flatnonzero(self.lengths() == 1).tolist()

    def lengths(self) -> np.ndarray:
        """Each id's byte length, -1 for None (as saved; measured once)."""
        if self._lengths is None:
            self._lengths = np.asarray([-1 if b is None else len(b) for b in self.token_bytes], dtype=np.int32)
        return self._lengths

    def save(self, path: Path, key: dict) -> None:
        """Write to `path` (aside, then renamed over it), with the key that says what it was made from."""
        lengths = self.lengths()
        blob = np.frombuffer(b"".join(b for b in self.token_bytes if b), dtype=np.uint8)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, key=np.asarray(json.dumps({**key, "style": self.style})), lengths=lengths, blob=blob,
                         special=np.asarray(sorted(self.special_ids), dtype=np.int64),
                         byte_fallback=np.asarray(sorted(self.byte_fallback_ids), dtype=np.int64))
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, key: dict) -> Tables | None:
        """The tables saved at `path`, if made from what `key` describes (else None)."""
        try:
            with np.load(path) as z:
                meta = json.loads(str(z["key"]))
                if {k: v for k, v in meta.items() if k != "style"} != key:
                    return None
                lengths, blob = z["lengths"], z["blob"].tobytes()
                special, fallback = set(z["special"].tolist()), set(z["byte_fallback"].tolist())
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            # damaged (zip's own CRC checks each member's bytes): spelled again and saved over it
            return None
        ends = np.cumsum(np.maximum(lengths, 0))
        if len(lengths) == 0 or lengths.min() < -1 or int(ends[-1]) != len(blob):
            return None
        starts = (ends - np.maximum(lengths, 0)).tolist()
        token_bytes: list[bytes | None] = [blob[a:b] for a, b in zip(starts, ends.tolist(), strict=True)]
        for i in np.flatnonzero(lengths < 0).tolist():
            token_bytes[i] = None
        tables = cls(meta["style"], special, token_bytes, fallback)
        tables._lengths = lengths
        return tables


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
        again while the tokenizer file and the EOS ids are unchanged; None: spell them."""
        path = Path(path)
        if not path.is_file():
            raise ArtifactError(f"tokenizer file {path} not found")
        source = path if cache is None else quick_source(path, cache)
        try:
            tok = _read_tokenizer(source)
        except ArtifactError:
            if source == path:
                raise
            assert cache is not None
            (cache / QUICK_KEY).unlink(missing_ok=True)  # a damaged copy: made again on the next load
            tok = _read_tokenizer(path)
        release_freed_memory()
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


def _style(tj: dict) -> str:
    if _has_type(tj.get("pre_tokenizer"), "ByteLevel") or _has_type(tj.get("decoder"), "ByteLevel"):
        return "byte_level"
    if tj.get("model", {}).get("type") == "WordPiece":
        return "wordpiece"
    return "sentencepiece"


def _piece_bytes(piece: str, style: str, byte_fallback: bool) -> bytes | None:
    if style == "byte_level":
        try:
            return bytes(BYTE_DECODER[c] for c in piece)
        except KeyError:
            return piece.encode("utf-8")  # not in the byte alphabet: stored as text
    if style == "wordpiece":
        # WordPiece's decoder puts spaces between words; a "##" piece continues the word.
        return piece[2:].encode() if piece.startswith("##") else (" " + piece).encode()
    m = _BYTE_FALLBACK.match(piece)
    if m and byte_fallback:
        return bytes([int(m.group(1), 16)])
    return piece.replace(SPM_SPACE, " ").encode("utf-8")


def same_vocabulary(a: Vocab, b: Vocab) -> bool:
    """Whether two tokenizers are the same vocabulary: same byte string for every id.

    Logits widths are not compared: models often pad their embedding matrix (151936 vs 152064).
    """
    return a.size == b.size and a.token_bytes == b.token_bytes and a.special_ids == b.special_ids


@dataclass
class VocabMaps:
    """Precomputed maps between a drafter vocabulary D and a target vocabulary T.

    intersection: int64 [|D|], the target id with the same bytes as each drafter id, or -1 (TLI).
    prefix: int64 [|D|], the longest target token whose bytes are a prefix of the drafter token's
        bytes, or -1 when none is (SLRS's g).
    """

    intersection: np.ndarray
    prefix: np.ndarray

    def save(self, path: Path) -> None:
        np.savez_compressed(path, intersection=self.intersection, prefix=self.prefix)

    @classmethod
    def load(cls, path: Path) -> VocabMaps:
        with np.load(path) as z:
            return cls(z["intersection"].astype(np.int64), z["prefix"].astype(np.int64))


def build_maps(drafter: Vocab, target: Vocab) -> VocabMaps:
    """Build the TLI intersection and the SLRS prefix map, EOS mapped to EOS explicitly."""
    by_bytes = target.by_bytes
    max_len = target.max_token_len
    inter = np.full(drafter.size, -1, dtype=np.int64)
    prefix = np.full(drafter.size, -1, dtype=np.int64)
    for d, b in enumerate(drafter.token_bytes):
        if not b:
            continue
        inter[d] = by_bytes.get(b, -1)
        prefix[d] = longest_prefix_token(by_bytes, b, max_len)
    if drafter.eos_ids and target.eos_ids:
        for d in drafter.eos_ids:
            inter[d] = target.eos_ids[0]
            prefix[d] = target.eos_ids[0]
    return VocabMaps(inter, prefix)


def longest_prefix_token(target_by_bytes: dict[bytes, int], data: bytes, max_len: int) -> int:
    """The longest target token whose bytes are a prefix of `data`, or -1."""
    for n in range(min(len(data), max_len), 0, -1):
        t = target_by_bytes.get(data[:n])
        if t is not None:
            return t
    return -1
