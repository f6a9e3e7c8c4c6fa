"""A smaller model of the same family drafts k tokens autoregressively, batched over all requests.

The draft keeps its own KV pool addressed by the same block ids as the target's. Each step it first
catches up on what it has not seen (a prompt chunk, or the tokens accepted last step plus the bonus),
drafting the first token from that same forward; then k - 1 single-token forwards draft the rest.
Rejected drafts need no rollback: the engine clamps `num_draft_computed_tokens` to the accepted prefix.
"""

from __future__ import annotations

import torch

from engine import structured
from engine.model_runner import ForwardInput, ModelRunner
from engine.proposers.base import Proposal
from engine.sampler import processed_probs, sample
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


class DraftModelProposer:
    def __init__(
        self,
        runner: ModelRunner,
        p_min: float = 0.0,
    ) -> None:
        self.runner = runner
        self.p_min = p_min

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        # The draft prefills prompts alongside the target, so drafting can start at any later step
        # with a short catch-up. In decode only requests drafting this step touch the draft: one
        # that skips steps (k = 0) catches up on what it missed when it drafts again.
        active = [item for item in batch if item.num_spec_tokens > 0]
        prefilling = [item for item in batch if item.num_spec_tokens == 0 and _prompt_lags(item)]
        drafts: dict[int, list[int]] = {id(item): [] for item in active}
        probs: dict[int, list[torch.Tensor]] = {id(item): [] for item in active}
        if prefilling and not active:
            self.runner.forward([self._prefill(item) for item in prefilling])
        step = 0
        while active:
            if step == 0:
                inputs = [self._catch_up(item) for item in active]
                inputs += [self._prefill(item) for item in prefilling]  # no logits: after the rows
            else:
                inputs = [self._feed_last(item, drafts[id(item)]) for item in active]
            confident = self._draft_one(active, self.runner.forward(inputs), drafts, probs)
            step += 1
            active = [
                item
                for item, ok in zip(active, confident, strict=True)
                if ok and item.num_spec_tokens > step
            ]
        return [self._proposal(item, drafts, probs) for item in batch]

    def _catch_up(self, item: ScheduledSeq) -> ForwardInput:
        seq = item.seq
        start, end = seq.num_draft_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
        seq.num_draft_computed_tokens = end
        return ForwardInput(seq.token_ids[start:end], start, seq.block_table, 1)

    def _prefill(self, item: ScheduledSeq) -> ForwardInput:
        """The prompt part of this step's chunk, for a request not drafting this step."""
        seq = item.seq
        start = seq.num_draft_computed_tokens
        end = min(seq.num_prompt_tokens, seq.num_computed_tokens + item.num_new_tokens)
        seq.num_draft_computed_tokens = end
        return ForwardInput(seq.token_ids[start:end], start, seq.block_table, 0)

    def _feed_last(self, item: ScheduledSeq, drafted: list[int]) -> ForwardInput:
        seq = item.seq
        start = seq.num_draft_computed_tokens
        seq.num_draft_computed_tokens += 1
        return ForwardInput(drafted[-1:], start, seq.block_table, 1)

    def _draft_one(
        self,
        active: list[ScheduledSeq],
        logits: torch.Tensor,  # [len(active), draft_vocab]
        drafts: dict[int, list[int]],
        probs: dict[int, list[torch.Tensor]],
    ) -> list[bool]:
        """Draft one token for each active request; False where the draft is no longer confident."""
        seqs = [item.seq for item in active]
        history = [
            seq.output_token_ids + drafts[id(item)] for seq, item in zip(seqs, active, strict=True)
        ]
        logits = structured.constrain_draft_logits(seqs, logits, [drafts[id(i)] for i in active])
        step_probs = processed_probs(logits, [seq.params for seq in seqs], history)
        tokens = sample(step_probs, [seq.generator for seq in seqs])
        # Confidence uses the raw draft distribution, so greedy (one-hot) rows are judged too.
        confidence = torch.softmax(logits, dim=-1)[torch.arange(len(tokens)), tokens].tolist()
        for row, (item, token) in enumerate(zip(active, tokens, strict=True)):
            drafts[id(item)].append(token)
            probs[id(item)].append(step_probs[row])
        return [p >= self.p_min for p in confidence]

    @staticmethod
    def _proposal(
        item: ScheduledSeq, drafts: dict[int, list[int]], probs: dict[int, list[torch.Tensor]]
    ) -> Proposal:
        if id(item) not in drafts:
            return Proposal.empty()
        seq: Sequence = item.seq
        stacked = None if seq.params.greedy else torch.stack(probs[id(item)])  # [k, draft_vocab]
        return Proposal(drafts[id(item)], stacked)


def _prompt_lags(item: ScheduledSeq) -> bool:
    """Does the draft miss prompt tokens that the target will have computed after this step?"""
    seq = item.seq
    end = min(seq.num_prompt_tokens, seq.num_computed_tokens + item.num_new_tokens)
    return seq.num_speculative_tokens > 0 and seq.num_draft_computed_tokens < end
