"""A loaded engine's tokenizer, read from a quicker form its runtime cache keeps beside the file.

`tokenizers` reads a BPE model's merges written as ["a", "b"] pairs through serde's untagged
buffering: for a vocabulary of hundreds of thousands of merges that buffering is most of the read's
time and most of its transient heap, which is what a loading process peaks on (figures in
benchmarks/results/startup.md). So the first load keeps one of two quicker forms in the cache:

- strings: a copy of the file whose merges are "a b" strings, the form the library reads without
  buffering, where no merge part is empty or holds a space (the string form splits on spaces);
- parts: where some part does hold a space (Gemma's merges of space runs, as a GGUF file's
  vocabulary spells them), the tokens, the merges as id pairs and the rest of the file, from which
  the tokenizer is assembled through the library's own constructors. That form is kept only if the
  tokenizer it gives serializes exactly as the file's does.

Either form is made again whenever the file's name, size or modification time change; a folder that
cannot be written to, or a form that fails to read, leaves the file read as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import BPE

from edge_sd.engines.host_memory import give_back
from edge_sd.errors import ArtifactError
from edge_sd.layout import QUICK_FILE, QUICK_KEY, QUICK_PARTS
from edge_sd.manifest import write_aside

# The layout's version of the quick forms (QUICK_FILE, QUICK_PARTS) and of their marker (QUICK_KEY).
QUICK_FORMAT = 2


def string_merges(tokenizer_json: dict) -> bool:
    """Rewrite a BPE model's merges from ["a", "b"] pairs to "a b" strings, in place, where that is the
    same list (no part empty or holding a space, which the string form splits on); whether it did."""
    merges = _pair_merges(tokenizer_json)
    if merges is None or not all(p and " " not in p for m in merges for p in m):
        return False
    tokenizer_json["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    return True


def _pair_merges(tokenizer_json: dict) -> list | None:
    """A BPE model's merges where they are all ["a", "b"] pairs of strings, else None."""
    model = tokenizer_json.get("model") if isinstance(tokenizer_json, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    merges = model.get("merges")
    if not isinstance(merges, list) or not merges:
        return None
    if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m) for m in merges):
        return None
    return merges


def save_parts(tokenizer_json: dict, path: Path) -> bool:
    """Write a BPE tokenizer with pair merges as parts (tokens, merge ids, the rest as JSON) to `path`;
    False, writing nothing, where the file is not one (another model, a merge of unknown tokens)."""
    merges = _pair_merges(tokenizer_json)
    if merges is None or not isinstance(tokenizer_json["model"].get("vocab"), dict):
        return False
    model = tokenizer_json["model"]
    vocab: dict[str, int] = model["vocab"]
    try:
        pairs = np.array([(vocab[a], vocab[b]) for a, b in merges], np.int64)
    except KeyError:
        return False
    tokens = list(vocab)
    rest = {"tokenizer": {**tokenizer_json, "added_tokens": [], "model": {"type": "BPE", "vocab": {}, "merges": []}},
            "options": {k: v for k, v in model.items() if k not in ("type", "vocab", "merges") and v is not None},
            "added": tokenizer_json.get("added_tokens") or []}
    text = "".join(tokens)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # the process's own, as write_aside's
    try:
        with open(tmp, "wb") as f:
            np.savez(f, text=np.frombuffer(text.encode("utf-8"), np.uint8),
                     lengths=np.array([len(t) for t in tokens], np.int64),
                     ids=np.fromiter(vocab.values(), np.int64, len(vocab)), merges=pairs,
                     rest=np.frombuffer(json.dumps(rest).encode("utf-8"), np.uint8))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def read_parts(path: Path) -> Tokenizer:
    """The tokenizer save_parts wrote: its vocabulary and merges through BPE's constructor, the added
    tokens added in their order (each takes its id in the vocabulary, as the file's do)."""
    with np.load(path, allow_pickle=False) as z:
        text = z["text"].tobytes().decode("utf-8")
        ends = np.cumsum(z["lengths"]).tolist()
        ids = z["ids"].tolist()
        merges = z["merges"]
        rest = json.loads(z["rest"].tobytes())
    tokens = [text[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    by_id = dict(zip(ids, tokens, strict=True))
    pairs = list(zip(map(by_id.__getitem__, merges[:, 0].tolist()), map(by_id.__getitem__, merges[:, 1].tolist()),
                     strict=True))
    tokenizer = Tokenizer.from_str(json.dumps(rest["tokenizer"]))
    tokenizer.model = BPE(dict(zip(tokens, ids, strict=True)), pairs, **rest["options"])
    del text, tokens, by_id, pairs
    tokenizer.add_tokens([AddedToken(a["content"], single_word=a["single_word"], lstrip=a["lstrip"],
                                     rstrip=a["rstrip"], normalized=a["normalized"], special=a["special"])
                          for a in rest["added"]])
    return tokenizer


def read_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ArtifactError(f"{path}: not a valid tokenizer.json ({e})") from None


def read_tokenizer(path: Path, cache: Path | None) -> Tokenizer:
    """`path`'s tokenizer, read through its quick form in `cache` (made on the first load; None: the
    file as it is). A form that does not read is dropped and made again on the next load."""
    source, tokenizer = (path, None) if cache is None else _quick_form(path, cache)
    if tokenizer is None:
        try:
            tokenizer = read_quick(source)
        except ArtifactError:
            if source == path:
                raise
            assert cache is not None
            (cache / QUICK_KEY).unlink(missing_ok=True)
            tokenizer = read_file(path)
    give_back()  # the parse's transient heap, kept by glibc's allocator otherwise
    return tokenizer


def quick_source(path: Path, cache: Path) -> Path:
    """The file to read `path`'s tokenizer from (read_quick reads either): the quick form in `cache`,
    made now if there is none for the file as it is, else `path` itself."""
    return _quick_form(path, cache)[0]


def _quick_form(path: Path, cache: Path) -> tuple[Path, Tokenizer | None]:
    """quick_source's file, and the tokenizer where making the form read it already (to check parts)."""
    stat = path.stat()
    key = {"format": QUICK_FORMAT, "tokenizer": [path.name, stat.st_size, stat.st_mtime_ns]}
    marker = cache / QUICK_KEY
    try:
        saved = json.loads(marker.read_text(encoding="utf-8"))
        if saved["key"] == key:
            return (cache / saved["copy"] if saved["copy"] in (QUICK_FILE, QUICK_PARTS) else path), None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        tokenizer_json = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return path, None  # reading it as it is reports what is wrong
    made: str | None = None
    tokenizer = None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if string_merges(tokenizer_json):
            write_aside(cache / QUICK_FILE, json.dumps(tokenizer_json, separators=(",", ":")))
            made = QUICK_FILE
        elif save_parts(tokenizer_json, cache / QUICK_PARTS):
            del tokenizer_json
            tokenizer = read_file(path)
            made = QUICK_PARTS if _assembles(cache / QUICK_PARTS, tokenizer) else None
        write_aside(marker, json.dumps({"key": key, "copy": made}) + "\n")
    except OSError:
        return path, tokenizer
    return (cache / made if made else path), tokenizer


def _assembles(parts: Path, tokenizer: Tokenizer) -> bool:
    """Whether the parts give `tokenizer`, serialized alike."""
    try:
        assembled = read_parts(parts).to_str()
    except Exception:  # a constructor refusing an option or token: the file is read as it is
        return False
    return assembled == tokenizer.to_str()


def read_quick(source: Path) -> Tokenizer:
    """The tokenizer of a file quick_source returned; ArtifactError where it does not read."""
    if source.name != QUICK_PARTS:
        return read_file(source)
    try:
        return read_parts(source)
    except Exception as e:  # a damaged file: numpy, zipfile, json and tokenizers each raise their own
        raise ArtifactError(f"{source}: not a readable tokenizer ({e})") from None
