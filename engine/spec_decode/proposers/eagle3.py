"""EAGLE-3: a one-layer head drafts from the target's own hidden states (engine/model/eagle3.py).

At position i the head reads the target's fused features h_i and the next token t_{i+1}, and
predicts t_{i+2}. Before drafting for a request it catches up on the positions the target has
computed since the head last ran, [frontier, num_computed), their features read from the target
runner's aux pool; the last of those rows (position num_computed - 1, whose next token is the one
the target computes this step) drafts the first token. Each further draft feeds the head's own
output back at the next position. The target's features exist only for computed positions, so a
request whose step computes more than its last token (a prompt's last chunk) drafts nothing this
step; it catches up in the next.

All drafting requests run together: one head forward for their catch-ups, then one per further
draft, the projections batched and the attention per request, over the head's K/V, which with its
frontier is this proposer's, one `HeadCache` per live request (a cache of its own for now, not the
paged pool). Drafts write positions past the frontier, which the next catch-up overwrites:
rejected drafts are rolled back by not advancing. Greedy drafts are the argmax; sampled ones are
drawn from the head's distribution after the request's own sampling parameters, over the target's
vocabulary (zero outside the draft vocabulary), so rejection sampling stays exact; seeded ones
with the noise of the position they fill, as the draft model does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from engine.model.eagle3 import Eagle3Head, HeadCache, HeadSpan
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
        """All drafting requests together: one head forward for their catch-ups (which drafts
        each one's first token), then one per further draft over those still drafting."""
        active = [i for i, item in enumerate(batch) if self._drafts(item)]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        states = {i: self._state(batch[i].seq) for i in active}
        rows, step = active, 0
        while rows:
            if step == 0:
                normed, hidden = self._catch_up(
                    [batch[i].seq for i in rows], [states[i] for i in rows]
                )
            else:  # the head's own output and each row's last draft, one position further
                spans = [
                    HeadSpan(states[i].cache, batch[i].seq.num_computed_tokens + step - 1, 1)
                    for i in rows
                ]
                tokens = self._ids([drafts[i][-1] for i in rows])
                normed, hidden = self.head(hidden, tokens, spans)  # [len(rows), hidden] each
            drafted = self._pick(batch, rows, self.head.logits(normed), drafts, probs)
            step += 1
            keep = [
                r
                for r, (i, ok) in enumerate(zip(rows, drafted, strict=True))
                if ok and batch[i].k_for(self.name) > step
            ]
            rows, hidden = [rows[r] for r in keep], hidden[keep]
        return [self._proposal(item, drafts.get(i), probs.get(i)) for i, item in enumerate(batch)]

    def _drafts(self, item: ScheduledSeq) -> bool:
        """Whether the request drafts this step: the head needs the target's features of every
        token before the last, so only a step that computes just the last one drafts."""
        return (
            item.k_for(self.name) > 0
            and item.num_new_tokens == 1
            and item.seq.num_computed_tokens > 0
        )

    def _state(self, seq: Sequence) -> _HeadState:
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _HeadState(self.head.new_cache())
        return state

    def _catch_up(
        self, seqs: list[Sequence], states: list[_HeadState]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [len(seqs), hidden] each: normed, prenorm
        """Run the head over the computed positions each request's head has not seen (at least the
        last one, which drafts); returns each request's last row."""
        spans, aux, tokens = [], [], []
        for seq, state in zip(seqs, states, strict=True):
            end = seq.num_computed_tokens
            start = min(state.frontier, end - 1)
            spans.append(HeadSpan(state.cache, start, end - start))
            aux.append(
                self.target.aux_hidden(seq.block_table, start, end)
            )  # [L, 3 * target_hidden]
            tokens += seq.token_ids[start + 1 : end + 1]  # the token after each position
            state.frontier = end
        hidden = self.head.fuse(torch.cat(aux))
        normed, prenorm = self.head(hidden, self._ids(tokens), spans)
        last = torch.tensor([span.length for span in spans]).cumsum(0) - 1
        return normed[last], prenorm[last]

    def _ids(self, token_ids: list[int]) -> torch.Tensor:  # [T] long on the head's device
        return torch.tensor(token_ids, dtype=torch.long, device=self.head.device)

    @staticmethod
    def _pick(
        batch: list[ScheduledSeq],
        rows: list[int],  # batch indices, one per logits row
        logits: torch.Tensor,  # [len(rows), vocab]: -inf outside the draft vocabulary
        drafts: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> list[bool]:
        """One draft for each row's request, and its q over the vocabulary; False where the
        request can draft nothing (its grammar allows no id the draft vocabulary has)."""
        seqs = [batch[i].seq for i in rows]
        logits = structured.constrain_draft_logits(
            [s.constraint for s in seqs], logits, [drafts[i] for i in rows]
        )
        proposes = torch.isfinite(logits.amax(dim=-1))  # [len(rows)]
        if not proposes.all():
            logits = torch.where(proposes[:, None], logits, 0.0)  # finite; the row is dropped
        history = [s.output_token_ids + drafts[i] for s, i in zip(seqs, rows, strict=True)]
        step_probs = processed_probs(logits, [s.params for s in seqs], history)
        # A seeded request drafts with the noise of the very position it drafts (as the target
        # samples it there): where q is close to p, the draft is the target's token.
        keys = [s.seeded_row_keys(1, ahead=len(drafts[i])) for s, i in zip(seqs, rows, strict=True)]
        tokens = sample(step_probs, [None if k is None else k[0] for k in keys])
        ok: list[bool] = proposes.tolist()
        for r, (i, token) in enumerate(zip(rows, tokens, strict=True)):
            if ok[r]:
                drafts[i].append(token)
                probs[i].append(step_probs[r])
        return ok

    def _proposal(
        self, item: ScheduledSeq, drafted: list[int] | None, probs: list[torch.Tensor] | None
    ) -> Proposal:
        if not drafted or probs is None:
            return Proposal.empty()
        # Greedy and seeded requests verify by matching the target's own token: q goes unread.
        matched = item.seq.params.greedy or item.seq.seed_stream is not None
        return Proposal(drafted, None if matched else torch.stack(probs), self.name)
