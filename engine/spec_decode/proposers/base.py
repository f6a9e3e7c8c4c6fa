"""The proposer interface. A new method (EAGLE, Medusa heads, layer skipping) implements `propose`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.tree import DraftTree


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]  # at most item.num_spec_tokens drafts
    probs: torch.Tensor | None = None  # [len(token_ids), vocab_size] draft probs; None = one-hot
    source: str = ""  # the proposer that drafted them ("draft", "ngram"), for metrics and k
    # The draft model's (or a head's) K/V frontier after this step (positions it has computed,
    # rejected drafts included); None when it did not run for this request. The scheduler applies it.
    num_draft_computed: int | None = None
    # A tree (engine/spec_decode/proposers/tree.py): each draft's parent index, -1 for a child of the
    # request's last token; None: a chain. Its probs row i is the q node i was drawn from.
    parents: tuple[int, ...] | None = None

    @property
    def tree(self) -> DraftTree | None:
        return None if self.parents is None else DraftTree(tuple(self.token_ids), self.parents)

    @staticmethod
    def empty() -> Proposal:
        return Proposal([])


class Proposer(Protocol):
    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        """One proposal per scheduled request (empty where it gets no drafts this step).
        Proposers never change a request's state: what they computed comes back in the Proposal."""
        ...


class NoProposer:
    """Plain decoding: no request gets drafts."""

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        return [Proposal.empty() for _ in batch]


def still_drafting(
    batch: list[ScheduledSeq],
    rows: list[int],  # the batch indices drafting this step
    drafted: list[bool],  # per row: whether it drafted a token this step
    steps_done: int,
    proposer: str,
) -> list[int]:
    """Positions in `rows` of the requests that drafted this step and want more than
    `steps_done` drafts from `proposer`."""
    return [
        r
        for r, (i, ok) in enumerate(zip(rows, drafted, strict=True))
        if ok and batch[i].k_for(proposer) > steps_done
    ]


def picked_proposal(
    item: ScheduledSeq, drafted: list[int] | None, probs: list[torch.Tensor] | None, name: str
) -> Proposal:
    """A head's or assistant's picks for one request (`Proposal.empty()` where it drafted none);
    greedy and seeded requests verify by matching the target's own token, so q goes unread."""
    if not drafted or probs is None:
        return Proposal.empty()
    matched = item.seq.params.greedy or item.seq.seed_stream is not None
    return Proposal(drafted, None if matched else torch.stack(probs), name)
