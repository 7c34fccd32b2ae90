"""The proposers a reply drafts with, built from the algorithm names the model resolves (auto's menu
or one named algorithm), all drafting from one drafter state."""

from __future__ import annotations

from typing import Any

import numpy as np

from edge_sd.algorithms.base import DrafterState, Proposer
from edge_sd.algorithms.chain import ChainProposer
from edge_sd.algorithms.lookup import LookupProposer
from edge_sd.algorithms.rdk import RDKProposer
from edge_sd.algorithms.slem import SLEMProposer
from edge_sd.algorithms.slrs import SLRSProposer
from edge_sd.algorithms.standard import MappedProposer, TLIProposer
from edge_sd.sampling import SamplingConfig


def drafter_state(model: Any, engine: Any, context: str, algos: tuple[str, ...]) -> DrafterState | None:
    """The drafter's state for a reply: its tokens of `context` (the text before the reply; its cache
    keeps the prefix it shares with what it held), or None when the context does not fit it."""
    drafter = model.drafter
    d_ids = drafter.with_bos(drafter.vocab.encode_text(context))
    if not 0 < len(d_ids) < drafter.manifest.max_context:
        return None
    # Healing the prompt's end suits proposers that hand over text; the others map the drafter's
    # tokens one by one, and the healed first token spans the prompt's end.
    drafting = {a.removeprefix("lookup+") for a in algos}
    heal = "slem" in drafting and not {"tli", "slrs", "rdk", "standard"} & drafting
    state = DrafterState(engine, drafter.vocab, d_ids, drafter.kept, heal=heal)
    cached = engine.cached_ids
    common = 0
    limit = min(len(cached), len(state.ids) - 1)  # the last id is fed again: its logits start a draft
    while common < limit and cached[common] == state.ids[common]:
        common += 1
    engine.truncate(common)
    return state


def proposers(model: Any, algos: tuple[str, ...], state: DrafterState | None, cfg: SamplingConfig,
              rng: np.random.Generator, committed: list[int]) -> dict[str, Proposer]:
    """One proposer per algorithm, all drafting from one drafter state (synced after each round);
    prompt lookup starts from the `committed` ids (the decoder hands it each round's). A chain
    `lookup+X` shares the menu's lookup and X where the menu has them."""
    drafter, maps, target = model.drafter, model.maps, model.target.vocab
    # Proposals cover the ids the target can emit: its logits, cut to its tokenizer (decoder.Decoder).
    width = model.target.manifest.scored_ids
    made: dict[str, Proposer] = {}

    def make(algo: str) -> Proposer:
        if algo not in made:
            made[algo] = build(algo)
        return made[algo]

    def build(algo: str) -> Proposer:
        if algo.startswith("lookup+"):
            lookup = make("lookup")
            assert isinstance(lookup, LookupProposer)
            return ChainProposer(lookup, make(algo.removeprefix("lookup+")), target, width)
        if algo == "lookup":
            return LookupProposer(committed)
        assert drafter is not None and maps is not None and state is not None
        if algo == "standard":
            identity = np.arange(drafter.vocab.size, dtype=np.int64)
            return MappedProposer(state, identity, width, cfg, rng, target.eos_ids)
        if algo == "tli":
            return TLIProposer(state, maps.intersection, width, cfg, rng, target.eos_ids)
        if algo == "slem":
            return SLEMProposer(state, target, drafter.vocab.eos_ids)
        if algo == "rdk":
            assert model.kernel is not None
            return RDKProposer(state, model.kernel, maps.intersection, target, width, cfg, rng)
        return SLRSProposer(state, target, maps.prefix, width, cfg, rng)

    return {a: make(a) for a in algos}
