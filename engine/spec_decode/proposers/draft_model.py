"""A smaller model of the same family drafts k tokens autoregressively, batched over all requests.

The draft keeps its own KV pool addressed by the same block ids as the target's. It runs only for
requests that draft this step: first it catches up on what it has not seen (a whole prompt the first
time, the tokens accepted last step plus the bonus, or whatever it missed while the request sat at
k = 0 or took n-gram drafts), drafting the first token from that same forward; then k - 1
single-token forwards draft the rest. It never changes a request: the K/V frontier it reached comes
back in the Proposal, and rejected drafts need no rollback (the scheduler clamps the frontier to the
accepted prefix).
"""

from __future__ import annotations

import torch

from engine.model.runner import ForwardInput, ModelRunner
from engine.sample import structured
from engine.sample.sampler import processed_probs, sample
from engine.sequence import ScheduledSeq, Sequence
from engine.spec_decode.proposers.base import Proposal


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner, p_min: float = 0.0) -> None:
        self.runner = runner
        self.p_min = p_min

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        active = [i for i, item in enumerate(batch) if item.k_for(self.name) > 0]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        frontier = {i: batch[i].seq.num_draft_computed_tokens for i in active}
        step = 0
        while active:
            if step == 0:
                inputs = [self._catch_up(batch[i], frontier, i) for i in active]
            else:
                inputs = [self._feed_last(batch[i], drafts[i], frontier, i) for i in active]
            logits = self.runner.forward(inputs)  # [len(active), draft_vocab]
            confident = self._draft_one([batch[i] for i in active], active, logits, drafts, probs)
            step += 1
            active = [
                i
                for i, ok in zip(active, confident, strict=True)
                if ok and batch[i].k_for(self.name) > step
            ]
        return [
            self._proposal(item, drafts.get(i), probs.get(i), frontier.get(i))
            for i, item in enumerate(batch)
        ]

    @staticmethod
    def _catch_up(item: ScheduledSeq, frontier: dict[int, int], key: int) -> ForwardInput:
        seq = item.seq
        start, end = frontier[key], seq.num_computed_tokens + item.num_new_tokens
        frontier[key] = end
        return ForwardInput(seq.token_ids[start:end], start, seq.block_table, 1)

    @staticmethod
    def _feed_last(
        item: ScheduledSeq, drafted: list[int], frontier: dict[int, int], key: int
    ) -> ForwardInput:
        start = frontier[key]
        frontier[key] += 1
        return ForwardInput(drafted[-1:], start, item.seq.block_table, 1)

    def _draft_one(
        self,
        items: list[ScheduledSeq],
        keys: list[int],
        logits: torch.Tensor,  # [len(items), draft_vocab]
        drafts: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> list[bool]:
        """Draft one token for each active request; False where the draft is no longer confident."""
        seqs = [item.seq for item in items]
        history = [seq.output_token_ids + drafts[key] for seq, key in zip(seqs, keys, strict=True)]
        logits = structured.constrain_draft_logits(
            [s.constraint for s in seqs], logits, [drafts[key] for key in keys]
        )
        # A row can leave the draft nothing to propose: a grammar that allows only ids beyond a
        # limited head (draft_vocab_size). It stops drafting; zeros keep its softmax finite.
        proposes = torch.isfinite(logits.amax(dim=-1))  # [len(items)]
        if not proposes.all():
            logits = torch.where(proposes[:, None], logits, 0.0)
        step_probs = processed_probs(logits, [seq.params for seq in seqs], history)
        # A seeded request drafts with the noise of the very position it drafts, the noise the
        # target samples that position with: where q is close to p, the draft is the target's token.
        row_keys = [_row_key(seq, len(drafts[key])) for seq, key in zip(seqs, keys, strict=True)]
        tokens = sample(step_probs, row_keys)
        # Confidence uses the raw draft distribution, so greedy (one-hot) rows are judged too.
        confidence = torch.softmax(logits, dim=-1)[torch.arange(len(tokens)), tokens]
        confident = (proposes & (confidence >= self.p_min)).tolist()
        for row, (key, token, ok) in enumerate(zip(keys, tokens, proposes.tolist(), strict=True)):
            if ok:
                drafts[key].append(token)
                probs[key].append(step_probs[row])
        return confident

    def _proposal(
        self,
        item: ScheduledSeq,
        drafted: list[int] | None,
        probs: list[torch.Tensor] | None,
        frontier: int | None,
    ) -> Proposal:
        if not drafted or probs is None:
            return Proposal.empty()
        # Greedy and seeded requests verify by matching the target's own token: q goes unread.
        matched = item.seq.params.greedy or item.seq.seed_stream is not None
        stacked = None if matched else torch.stack(probs)  # [k, draft_vocab]
        return Proposal(drafted, stacked, self.name, frontier)


def _row_key(seq: Sequence, num_drafted: int) -> int | None:
    """The seeded noise key of the output position this draft fills; None for unseeded requests."""
    keys = seq.seeded_row_keys(1, ahead=num_drafted)
    return None if keys is None else keys[0]
