"""Token bytes: the byte string every id of a tokenizer.json spells (GPT-2's byte-level alphabet,
SentencePiece's visible space and `<0xNN>` byte fallback; none for special tokens), and UTF-8
boundaries. Text is handled as bytes everywhere in the loop (docs/algorithms.md, "Lossless,
precisely"): a drafter token can end in the middle of a UTF-8 character."""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


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
