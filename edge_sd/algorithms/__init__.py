"""Proposers and verifiers, one module per algorithm of docs/algorithms.md."""

from edge_sd.algorithms.base import Draft, DrafterState, Proposer
from edge_sd.algorithms.chain import ChainProposer
from edge_sd.algorithms.lookup import LookupProposer, verify_point
from edge_sd.algorithms.rdk import Kernel, RDKProposer
from edge_sd.algorithms.slem import SLEMProposer, verify_exact
from edge_sd.algorithms.slrs import SLRSProposer
from edge_sd.algorithms.standard import MappedProposer, TLIProposer, verify_greedy, verify_standard

# "plain" is plain autoregressive decoding of the target (the reference); "auto" chooses per round
# (generator.py); "lookup" drafts from the text itself (no drafter needed); "lookup+X" proposes the
# lookup's continuation, then X's draft continuing it (algorithms/chain.py).
DRAFTING = ("standard", "slem", "tli", "slrs", "rdk")
CHAINED = tuple(f"lookup+{a}" for a in DRAFTING)
ALGORITHMS = ("auto", "plain", *DRAFTING, "lookup", *CHAINED)

__all__ = [
    "ALGORITHMS", "CHAINED", "DRAFTING", "ChainProposer",
    "Draft", "DrafterState", "Kernel", "LookupProposer", "RDKProposer", "MappedProposer", "Proposer",
    "SLEMProposer", "SLRSProposer", "TLIProposer", "verify_exact", "verify_greedy", "verify_point", "verify_standard",
]
