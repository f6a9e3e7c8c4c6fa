"""Draft proposers: each fills up to k speculative tokens per request for the target to verify."""

from engine.proposers.base import Proposal, Proposer
from engine.proposers.draft_model import DraftModelProposer
from engine.proposers.hybrid import HybridProposer
from engine.proposers.ngram import NgramProposer

__all__ = ["DraftModelProposer", "HybridProposer", "NgramProposer", "Proposal", "Proposer"]
