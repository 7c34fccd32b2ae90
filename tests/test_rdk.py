"""RDK (docs/algorithms.md, "The proposers"): the kernel, the pruning choices and the LM-head surgery.

End-to-end losslessness of RDK and of every algorithm on pruned drafters is in test_lossless.py.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_verifiers import N, V, dists, first_tokens, tv, tv_bound

from edge_sd.algorithms.rdk import Kernel, twins_of_targets
from edge_sd.algorithms.standard import verify_standard
from edge_sd.errors import UsageError
from edge_sd.export.prune import _acceptance, build_kernel, calibration_samples, choose_kept, frequencies, prune_pair
from edge_sd.manifest import load_engine_manifest, load_pair_manifest
from edge_sd.sampling import sample
from edge_sd.vocab import Vocab
from edge_sd.vocab_maps import VocabMaps

import tiny


def random_kernel(seed: int, rows: int, cols: int, density: float = 0.5) -> tuple[Kernel, np.ndarray]:
    """A random sparse row-stochastic kernel, and the same as a dense matrix."""
    rng = np.random.default_rng(seed)
    dense = rng.random((rows, cols)) * (rng.random((rows, cols)) < density)
    dense[np.arange(rows), rng.integers(0, cols, rows)] += 0.1  # no empty row
    dense /= dense.sum(axis=1, keepdims=True)
    r, c = np.nonzero(dense)
    return Kernel(r, c, dense[r, c]), dense


def test_kernel_push_is_q_times_m() -> None:
    kernel, dense = random_kernel(0, 9, V)
    q = dists(1, 1, 9)[0]
    assert np.allclose(kernel.push(q, V), q @ dense)
    assert np.isclose(kernel.push(q, V).sum(), 1.0)
    assert np.allclose(kernel.push(q, V - 2), (q @ dense)[: V - 2])  # cut to the target's width


def test_rdk_proposal_verified_by_the_standard_rule_emits_p() -> None:
    """Draw d ~ q, then t ~ M[d]; verify against psi = q^T M: the first emitted token follows p."""
    kernel, dense = random_kernel(2, 5, V, density=0.6)
    q, p = dists(3, 1, 5)[0], dists(4, 2)
    psi = kernel.push(q, V)

    def run(rng, proposal=psi):
        t = sample(dense[sample(q, rng)], rng)
        a, nxt = verify_standard([t], proposal[None], p, rng)
        return t if a == 1 else nxt

    assert tv(first_tokens(run), p[0]) < tv_bound(V)
    # A wrong proposal distribution (q's rows read as target ids, as if M were the identity) fails.
    wrong = np.zeros(V)
    wrong[:5] = q
    assert tv(first_tokens(lambda rng: run(rng, wrong)), p[0]) > tv_bound(V)
    assert N > 0


def test_twins_of_targets_takes_the_lowest_drafter_id() -> None:
    inter = np.array([3, -1, 3, 0, 7])
    twin = twins_of_targets(inter, 5)
    assert twin.tolist() == [3, -1, -1, 0, -1]  # 7 is past the target's width


@pytest.fixture(scope="module")
def vocabs(tiny_root: Path) -> tuple[Vocab, Vocab, VocabMaps]:
    folder = tiny_root / "pairs" / "gemma_qwen"
    d, t = load_engine_manifest(folder / "drafter"), load_engine_manifest(folder / "target")
    dv = Vocab.from_file(folder / "drafter" / d.tokenizer_file, d.eos_token_ids)
    tv_ = Vocab.from_file(folder / "target" / t.tokenizer_file, t.eos_token_ids)
    return dv, tv_, VocabMaps.load(folder / "maps.npz")


def test_kept_tokens_twins_first_by_frequency(vocabs) -> None:
    dv, _, maps = vocabs
    freq = frequencies(dv, ["\n".join(tiny.corpus())])
    assert np.isclose(freq.sum(), 1.0)
    kept = choose_kept(maps, dv, freq, 0.25)
    assert len(kept) == round(0.25 * dv.size) and np.all(np.diff(kept) > 0)
    assert set(dv.eos_ids) <= set(kept.tolist())
    twins = np.nonzero(maps.intersection >= 0)[0]
    assert len(twins) > len(kept) and (maps.intersection[kept] >= 0).all()
    # Every dropped twin is at most as frequent as the rarest kept one (EOS aside).
    dropped = np.setdiff1d(twins, kept)
    rest = np.setdiff1d(kept, dv.eos_ids)
    assert freq[dropped].max() <= freq[rest].min()
    for bad in (0.0, 1.5):
        with pytest.raises(UsageError, match="drafter-vocab-keep"):
            choose_kept(maps, dv, freq, bad)


def test_kernel_rows_are_stochastic_and_restore_lost_tokens(pipelines, vocabs) -> None:
    dv, _, maps = vocabs
    pipe = pipelines["gemma_qwen"]
    text = ["\n".join(tiny.corpus())]
    samples = calibration_samples(pipe.target, pipe.drafter, maps, text, chunks=4)
    top_mass = samples.d_probs.sum(axis=1)  # the largest 32 entries of a distribution over 384 tokens
    assert len(samples.d_ids) > 100 and (top_mass <= 1 + 1e-9).all() and top_mass.mean() > 0.9
    assert (maps.intersection[samples.d_ids] >= 0).all()  # the drafter's side is over its twins
    kept = choose_kept(maps, dv, frequencies(dv, text), 0.5)
    rows, cols, vals = build_kernel(maps, kept, samples)
    sums = np.bincount(rows, weights=vals)
    assert np.allclose(sums[np.unique(rows)], 1.0) and (vals > 0).all()
    assert set(np.unique(rows).tolist()) == {int(d) for d in kept if maps.intersection[d] >= 0}
    reachable = set(maps.intersection[kept].tolist())
    restored = {int(c) for c in cols} - reachable
    assert restored, "the kernel moved no mass to a target token the pruned drafter cannot propose"
    # Its strength was chosen on the samples: at least TLI's acceptance there (strength 0).
    is_kept = np.zeros(len(maps.intersection), dtype=bool)
    is_kept[kept] = True
    q = samples.d_probs * is_kept[samples.d_ids]
    use = q.sum(axis=1) > 0
    args = (samples.d_ids[use], q[use] / q[use].sum(axis=1, keepdims=True), samples.t_ids[use], samples.t_probs[use])
    twin_only = np.array([maps.intersection[r] == c for r, c in zip(rows, cols, strict=True)])
    tli_rows = rows[twin_only].astype(np.int64)
    tli = _acceptance(tli_rows, cols[twin_only].astype(np.int64), np.ones(len(tli_rows)), *args)
    assert _acceptance(rows.astype(np.int64), cols.astype(np.int64), vals, *args) >= tli


def test_pruned_pair_records_what_it_did(tiny_root: Path) -> None:
    folder = tiny_root / "pairs" / "gemma_qwen_keep50"
    pm, dm = load_pair_manifest(folder), load_engine_manifest(folder / "drafter")
    kept = np.load(folder / "drafter" / dm.kept_ids_file)
    assert pm.rdk_file and dm.logits_width == len(kept) == pm.stats["drafter_kept"]
    assert pm.stats["pruned_head_max_rel_diff"] <= 1e-4


@pytest.mark.parametrize("pair", ["gemma_qwen", "gemma_qwen_opt"])
def test_pruned_head_gives_the_kept_columns(tiny_root: Path, tmp_path: Path, pair: str) -> None:
    """The pruned engine's logits are the full engine's on the kept rows (a MatMul head on the builder
    graph, a transposed tied embedding on optimum's)."""
    from edge_sd.engines.ort import OrtEngine

    folder = tmp_path / pair
    shutil.copytree(tiny_root / "pairs" / pair, folder)
    ids = np.arange(3, 40)
    full = OrtEngine(folder / "drafter", provider="cpu").forward(ids)
    prune_pair(folder, 0.3, ["\n".join(tiny.corpus())])
    engine = OrtEngine(folder / "drafter", provider="cpu", verify_files=True)
    kept = np.load(folder / "drafter" / engine.manifest.kept_ids_file)
    assert np.allclose(engine.forward(ids), full[:, kept], rtol=1e-5, atol=1e-5)
    with pytest.raises(UsageError, match="pruned already"):
        prune_pair(folder, 0.3, ["x"])


def test_rdk_needs_a_kernel(pipelines) -> None:
    from edge_sd import GenerationConfig

    with pytest.raises(UsageError, match="drafter-vocab-keep"):
        pipelines["gemma_qwen"].generate("The cat", GenerationConfig(algorithm="rdk"))
    pipe = pipelines["gemma_qwen_keep50"]
    assert pipe.candidates("auto") == ("tli", "slrs", "rdk", "lookup", "lookup+tli", "lookup+slrs", "lookup+rdk")
    assert pipe.candidates("auto", greedy=True) == ("slem", "lookup", "lookup+slem")


def test_pruning_with_corpus_lines_longer_than_the_context(tiny_root: Path, tmp_path: Path, vocabs) -> None:
    """Corpus chunks and the pruning probe are cut to each engine's maximum context (256 here): one
    line of the whole tiny corpus is thousands of tokens."""
    folder = tmp_path / "pair"
    shutil.copytree(tiny_root / "pairs" / "gemma_qwen", folder)
    line = " ".join(x.replace("\n", " ") for x in tiny.corpus())
    assert len(vocabs[0].encode_text(line)) > load_engine_manifest(folder / "drafter").max_context
    stats = prune_pair(folder, 0.5, [line, line])
    assert stats["kernel_sample_positions"] > 0 and stats["pruned_head_max_rel_diff"] <= 1e-4


def test_pruning_a_drafter_whose_tokenizer_outgrows_its_head(tiny_root: Path, tmp_path: Path) -> None:
    """Gemma 3's tokenizer has one token more than its LM head has rows: the calibration reads the
    drafter's logits over the ids both have, and no kept id lies past the head (pruning the pair
    failed on the mask's width before)."""
    import json

    from edge_sd.export.pair import write_pair
    from edge_sd.manifest import file_entries, save

    folder = tmp_path / "pair"
    shutil.copytree(tiny_root / "pairs" / "gemma_qwen", folder)
    dm = load_engine_manifest(folder / "drafter")
    path = folder / "drafter" / dm.tokenizer_file
    data = json.loads(path.read_text(encoding="utf-8"))
    data["added_tokens"].append({"id": dm.logits_width, "content": "<extra_0>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": False})
    path.write_text(json.dumps(data), encoding="utf-8")
    save(replace(dm, files=file_entries(folder / "drafter")), folder / "drafter")
    write_pair(folder, load_engine_manifest(folder / "target"), load_engine_manifest(folder / "drafter"))
    assert Vocab.from_file(path, dm.eos_token_ids).size == dm.logits_width + 1
    stats = prune_pair(folder, 1.0, ["\n".join(tiny.corpus())])
    kept = np.load(folder / "drafter" / "kept_ids.npy")
    assert stats["drafter_kept"] == len(kept) == dm.logits_width and kept.max() < dm.logits_width
