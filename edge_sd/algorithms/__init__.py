"""Proposers and verifiers, one module per algorithm of ALGORITHMS.md."""

from edge_sd.algorithms.base import Draft, DrafterState, Proposer
from edge_sd.algorithms.lookup import LookupProposer, verify_point
from edge_sd.algorithms.rdk import Kernel, RDKProposer
from edge_sd.algorithms.slem import SLEMProposer, verify_exact
from edge_sd.algorithms.slrs import SLRSProposer
from edge_sd.algorithms.standard import MappedProposer, TLIProposer, verify_greedy, verify_standard

# "plain" is plain autoregressive decoding of the target (the reference); "auto" chooses per round
# (generator.py); "lookup" drafts from the text itself (no drafter needed).
ALGORITHMS = ("auto", "plain", "standard", "slem", "tli", "slrs", "rdk", "lookup")

__all__ = [
    "ALGORITHMS", "Draft", "DrafterState", "Kernel", "LookupProposer", "RDKProposer", "MappedProposer", "Proposer",
    "SLEMProposer", "SLRSProposer", "TLIProposer", "verify_exact", "verify_greedy", "verify_point", "verify_standard",
]
