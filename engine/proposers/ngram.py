"""Prompt lookup: find the latest earlier occurrence of the text's last n tokens, propose what followed."""

from __future__ import annotations

from engine import structured
from engine.config import SpeculativeConfig
from engine.proposers.base import Proposal
from engine.scheduler import ScheduledSeq


def ngram_lookup(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram."""
    length = len(token_ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = token_ids[length - n :]
        # Scan right to left so the most recent (most relevant) occurrence wins.
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_min = config.ngram_min
        self.n_max = config.ngram_max

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        return [self.propose_one(item) for item in batch]

    def propose_one(self, item: ScheduledSeq) -> Proposal:
        k = item.k_for(self.name)
        if k == 0:
            return Proposal.empty()
        drafts = structured.cut_drafts(
            item.seq, ngram_lookup(item.seq.token_ids, k, self.n_min, self.n_max)
        )
        return Proposal(drafts, source=self.name) if drafts else Proposal.empty()
