"""EAGLE-3: a one-layer head drafts from the target's own hidden states (engine/model/eagle3.py).

At position i the head reads the target's fused features h_i and the next token t_{i+1}, and
predicts t_{i+2}. Before drafting for a request it catches up on the positions the target has
computed since the head last ran, [frontier, num_computed), their features read from the target
runner's aux pool; the last of those rows (position num_computed - 1, whose next token is the one
the target computes this step) drafts the first token. Each further draft feeds the head's own
output back at the next position. The target's features exist only for computed positions, so a
request whose step computes more than its last token (a prompt's last chunk) drafts nothing this
step; it catches up in the next.

The head's K/V and frontier are this proposer's, one `HeadCache` per live request (a cache of its
own for now, not the paged pool). Drafts write positions past the frontier, which the next catch-up
overwrites: rejected drafts are rolled back by not advancing. Greedy drafts are the argmax; sampled
ones are drawn from the head's distribution after the request's own sampling parameters, over the
target's vocabulary (zero outside the draft vocabulary), so rejection sampling stays exact; seeded
ones with the noise of the position they fill, as the draft model does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from engine.model.eagle3 import Eagle3Head, HeadCache
from engine.model.runner import ModelRunner
from engine.sample import structured
from engine.sample.sampler import processed_probs, sample
from engine.sequence import ScheduledSeq, Sequence
from engine.spec_decode.proposers.base import Proposal


@dataclass
class _HeadState:
    cache: HeadCache
    frontier: int = 0  # the head's K/V of positions [0, frontier) are from the target's features


class Eagle3Proposer:
    name = "eagle3"

    def __init__(self, head: Eagle3Head, target: ModelRunner) -> None:
        self.head = head
        self.target = target  # keeps the aux hidden states the head reads
        self._states: weakref.WeakKeyDictionary[Sequence, _HeadState] = (
            weakref.WeakKeyDictionary()
        )  # one per live request

    @torch.inference_mode()
    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        return [self._propose_one(item) for item in batch]

    def _propose_one(self, item: ScheduledSeq) -> Proposal:
        seq, k = item.seq, item.k_for(self.name)
        if k == 0 or item.num_new_tokens != 1 or seq.num_computed_tokens == 0:
            return Proposal.empty()  # no features yet for the tokens before the last
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _HeadState(self.head.new_cache())
        normed, hidden = self._catch_up(seq, state)  # [1, hidden] each
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            if j:  # the head's own output and its last draft, one position further
                position = seq.num_computed_tokens + j - 1
                normed, hidden = self.head(hidden, self._ids(drafts[-1:]), position, state.cache)
            picked = self._pick(seq, drafts, self.head.logits(normed))
            if picked is None:
                break
            drafts.append(picked[0])
            probs.append(picked[1])
        if not drafts:
            return Proposal.empty()
        # Greedy and seeded requests verify by matching the target's own token: q goes unread.
        matched = seq.params.greedy or seq.seed_stream is not None
        return Proposal(drafts, None if matched else torch.stack(probs), self.name)

    def _catch_up(self, seq: Sequence, state: _HeadState) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over the computed positions it has not seen (at least the last one, which
        drafts); returns that last row's normed output and prenorm: [1, hidden] each."""
        end = seq.num_computed_tokens
        start = min(state.frontier, end - 1)
        aux = self.target.aux_hidden(seq.block_table, start, end)  # [T, 3 * target_hidden]
        tokens = self._ids(seq.token_ids[start + 1 : end + 1])  # the token after each position
        normed, prenorm = self.head(self.head.fuse(aux), tokens, start, state.cache)
        state.frontier = end
        return normed[-1:], prenorm[-1:]

    def _ids(self, token_ids: list[int]) -> torch.Tensor:  # [T] long on the head's device
        return torch.tensor(token_ids, dtype=torch.long, device=self.head.device)

    @staticmethod
    def _pick(
        seq: Sequence,
        drafts: list[int],  # the request's drafts before this one
        logits: torch.Tensor,  # [1, vocab]: -inf outside the draft vocabulary
    ) -> tuple[int, torch.Tensor] | None:  # the draft and q over the vocabulary [vocab]; None: stop
        logits = structured.constrain_draft_logits([seq.constraint], logits, [drafts])
        if not torch.isfinite(logits.amax()):
            return None  # the grammar allows nothing the draft vocabulary has
        probs = processed_probs(logits, [seq.params], [seq.output_token_ids + drafts])
        # A seeded request drafts with the noise of the very position it drafts (as the target
        # samples it there): where q is close to p, the draft is the target's token.
        keys = seq.seeded_row_keys(1, ahead=len(drafts))
        token = sample(probs, [None if keys is None else keys[0]])[0]
        return token, probs[0]
