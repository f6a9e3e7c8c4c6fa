"""Draft proposers: each fills up to k speculative tokens per request for the target to verify."""

from engine.spec_decode.proposers.base import NoProposer, Proposal, Proposer
from engine.spec_decode.proposers.draft_model import DraftModelProposer
from engine.spec_decode.proposers.eagle3 import Eagle3Proposer, MtpProposer
from engine.spec_decode.proposers.hybrid import HybridProposer
from engine.spec_decode.proposers.ngram import NgramProposer

__all__ = [
    "DraftModelProposer",
    "Eagle3Proposer",
    "HybridProposer",
    "MtpProposer",
    "NgramProposer",
    "NoProposer",
    "Proposal",
    "Proposer",
]
