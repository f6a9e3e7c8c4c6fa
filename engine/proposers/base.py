"""The proposer interface. A new method (EAGLE, Medusa heads, layer skipping) implements `propose`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.scheduler import ScheduledSeq


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]  # at most item.num_spec_tokens drafts
    probs: torch.Tensor | None = None  # [len(token_ids), vocab_size] draft probs; None = one-hot

    @staticmethod
    def empty() -> Proposal:
        return Proposal([])


class Proposer(Protocol):
    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        """One proposal per scheduled request (empty where it gets no drafts this step)."""
        ...
