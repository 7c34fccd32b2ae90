"""Export one engine, or a target and a drafter with their vocabulary maps, atomically."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from edge_sd.errors import UsageError
from edge_sd.export.atomic import atomic_folder
from edge_sd.export.hf import ExportOptions, Step, _null_step, export_engine, source_name, tokenizer_file
from edge_sd.layout import DRAFTER_DIR, MAPS_FILE, TARGET_DIR
from edge_sd.manifest import FORMAT_VERSION, EngineManifest, PairManifest, save, sha256_file
from edge_sd.tools.paths import cache_dir
from edge_sd.vocab import Vocab
from edge_sd.vocab_maps import build_maps, same_vocabulary


def default_out(target: str, drafter: str | None) -> Path:
    name = source_name(target) + (f"_{source_name(drafter)}" if drafter else "")
    return Path("engines") / name


def export(
    target: str,
    drafter: str | None,
    out: Path,
    opts: ExportOptions,
    tokenizer: str | None = None,
    drafter_tokenizer: str | None = None,
    force: bool = False,
    step: Step = _null_step,
    drafter_opts: ExportOptions | None = None,
    vocab_keep: float | None = None,
    corpus: list[Path] | None = None,
    cache: Path | None = None,
) -> dict:
    """Export into `out`; returns what the CLI summarises. Nothing is left behind on failure.

    `drafter_opts` (default: `opts` without its chat template) lets the drafter take another precision
    than the target.
    `vocab_keep`: prune the drafter's LM head to this fraction of its vocabulary, ranked on `corpus`
    (files, one domain each; default: a corpus fetched from the registries into `cache`), and build
    RDK's kernel (`edge_sd.export.prune`).
    """
    summary: dict = {"out": str(out), "engines": {}}
    drafter_opts = drafter_opts or replace(opts, chat_template=None)
    check(target, drafter, opts, drafter_opts, tokenizer, drafter_tokenizer, vocab_keep)
    with atomic_folder(out, force=force) as tmp:
        if drafter is None:
            m = export_engine(target, tmp, opts, tokenizer, step)
            summary["engines"]["model"] = _engine_summary(m, tmp)
            return summary
        engines: dict[str, EngineManifest] = {}
        sides = (
            ("target", target, tokenizer, opts),
            ("drafter", drafter, drafter_tokenizer, replace(drafter_opts, drafter=True)),
        )
        for role, src, tok, role_opts in sides:
            where = tmp / (TARGET_DIR if role == "target" else DRAFTER_DIR)
            where.mkdir()
            engines[role] = export_engine(src, where, role_opts, tok, step, name=source_name(src))
            summary["engines"][role] = _engine_summary(engines[role], where)
        with step("vocabulary maps (TLI intersection, SLRS prefix map)"):
            stats = write_pair(tmp, engines["target"], engines["drafter"], name=Path(out).name)
        if opts.device == "cpu":
            with step("the engines' costs (what seeded generations plan with)"):
                write_costs(tmp)
        if vocab_keep is not None:
            from edge_sd.export.prune import corpus_texts, prune_pair

            with step(f"drafter vocabulary pruned to {vocab_keep:g}, RDK kernel"):
                stats |= prune_pair(tmp, vocab_keep, corpus_texts(corpus, cache or cache_dir()))
        summary["pair"] = stats
    return summary


def check(target: str, drafter: str | None, opts: ExportOptions, drafter_opts: ExportOptions | None = None,
          tokenizer: str | None = None, drafter_tokenizer: str | None = None, vocab_keep: float | None = None) -> None:
    """Refuse an export that cannot work before anything is read, downloaded or made."""
    opts.check(target)
    if drafter is not None:
        (drafter_opts or opts).check(drafter)
    for tok in (tokenizer, drafter_tokenizer):
        if tok:
            tokenizer_file(tok)
    if vocab_keep is not None and drafter is None:
        raise UsageError("--drafter-vocab-keep prunes a drafter: give one with --drafter")
    if vocab_keep is not None and not 0 < vocab_keep <= 1:  # also refuses nan
        raise UsageError(f"--drafter-vocab-keep is the fraction of the vocabulary kept, in (0, 1]; got {vocab_keep}")
    if vocab_keep is not None and "cuda" in (opts.device, (drafter_opts or opts).device):
        from edge_sd.engines.providers import available_providers

        if "cuda" not in available_providers():  # say so now, not after minutes of exporting
            raise UsageError("--drafter-vocab-keep runs both models to build RDK's kernel: with --device cuda "
                             "it needs a machine with CUDA")


def write_costs(folder: Path) -> None:
    """Measure the pair's engines (a target forward over 1..k+1 positions, a drafter step, a drafter
    position caught up) and store them in costs.json: sampled generations with a seed plan from these
    instead of live timings (Model.fixed_costs); `edge-sd calibrate` measures them again."""
    from edge_sd import costs
    from edge_sd.model import Model
    from edge_sd.schedules.choose import DEFAULT_MAX_LOOKAHEAD

    costs.save(folder, Model.load(folder, provider="cpu").measure_costs(DEFAULT_MAX_LOOKAHEAD))


def write_pair(folder: Path, target: EngineManifest, drafter: EngineManifest, name: str | None = None) -> dict:
    """Write the maps and the pair manifest into a folder that holds the target and drafter engine
    folders."""
    tv = Vocab.from_file(folder / TARGET_DIR / target.tokenizer_file, target.eos_token_ids)
    dv = Vocab.from_file(folder / DRAFTER_DIR / drafter.tokenizer_file, drafter.eos_token_ids)
    maps = build_maps(dv, tv)
    maps.save(folder / MAPS_FILE)
    stats = {
        "target_vocab": tv.size,
        "drafter_vocab": dv.size,
        "intersection": int((maps.intersection >= 0).sum()),
        "prefix_mapped": int((maps.prefix >= 0).sum()),
    }
    pm = PairManifest(
        format_version=FORMAT_VERSION,
        name=name or folder.name,  # the folder's final name, not that of the one it is built in
        target=TARGET_DIR,
        drafter=DRAFTER_DIR,
        same_vocabulary=same_vocabulary(tv, dv),
        maps_file=MAPS_FILE,
        target_tokenizer_sha256=sha256_file(folder / TARGET_DIR / target.tokenizer_file),
        drafter_tokenizer_sha256=sha256_file(folder / DRAFTER_DIR / drafter.tokenizer_file),
        stats=stats,
    )
    save(pm, folder)
    return {**stats, "same_vocabulary": pm.same_vocabulary}


def _engine_summary(m: EngineManifest, folder: Path) -> dict:
    return {
        "name": m.name,
        "architecture": m.architecture,
        "export_path": m.export_path,
        "precision": m.precision,
        "min_step_positions": m.min_step_positions,
        "min_head_rows": m.min_head_rows,
        "vocab": m.vocab_size,
        "logits_width": m.logits_width,
        "max_context": m.max_context,
        "files": {f.path: f.bytes for f in m.files},
        "validation": m.validation,
    }
