"""Hybrid: per request and per step, an n-gram match proposes for free; the draft (a draft model or
an EAGLE-3 head) runs only for the requests without one. Code, quotes and edits often repeat what
came before, and there the lookup is both free and right; open text rarely matches, and there the
draft does the work."""

from __future__ import annotations

from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.base import Proposal, Proposer
from engine.spec_decode.proposers.ngram import NgramProposer


class HybridProposer:
    def __init__(self, ngram: NgramProposer, draft: Proposer) -> None:
        self.ngram = ngram
        self.draft = draft

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        proposals = [self.ngram.propose_one(item) for item in batch]
        unmatched = [i for i, p in enumerate(proposals) if not p.token_ids]
        drafted = self.draft.propose([batch[i] for i in unmatched])
        for i, proposal in zip(unmatched, drafted, strict=True):
            proposals[i] = proposal
        return proposals
