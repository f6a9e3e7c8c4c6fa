"""Grammar-forced drafts: where a request's grammar leaves a single legal continuation, those
tokens are its drafts, at no draft forward (jump-forward decoding that stays lossless).

The scheduler reserves room for them (`spec_k["grammar"]`) whatever the request's k for the other
proposers. They are verified like any drafts: the choice depends only on the grammar state, never on a
sampled value, and a deterministic draft has q one-hot, so rejection sampling stays exact. A
request drafting forced tokens skips the wrapped proposer this step; a draft model catches up
on the tokens it missed the next time it drafts.
"""

from __future__ import annotations

from engine.sample import structured
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.base import Proposal, Proposer


class ForcedDraftProposer:
    def __init__(self, inner: Proposer) -> None:
        self.inner = inner

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        forced = [
            structured.forced_tokens(item.seq.constraint, item.k_for(structured.FORCED_SOURCE))
            for item in batch
        ]
        rest = [item for item, tokens in zip(batch, forced, strict=True) if not tokens]
        proposed = iter(self.inner.propose(rest))
        return [
            Proposal(tokens, source=structured.FORCED_SOURCE) if tokens else next(proposed)
            for tokens in forced
        ]
