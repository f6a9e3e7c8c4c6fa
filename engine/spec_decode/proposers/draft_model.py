"""A smaller model of the same family drafts k tokens autoregressively, batched over all requests.

The draft keeps its own KV pool addressed by the same block ids as the target's. It runs only for
requests that draft this step: first it catches up on what it has not seen (a whole prompt the first
time, the tokens accepted last step plus the bonus, or whatever it missed while the request sat at
k = 0 or took n-gram drafts), drafting the first token from that same forward; then k - 1
single-token forwards draft the rest. It never changes a request: the K/V frontier it reached comes
back in the Proposal, and rejected drafts need no rollback (the scheduler clamps the frontier to the
accepted prefix).

On a GPU the k forwards run without a host sync (`_propose_on_device`): the picks stay on the
device and feed the next forward, every active request drafts its whole k, and one copy at the end
brings the drafts to the host, where those after a request's first unsure pick (`p_min`) are
dropped. On a CPU, where reading a result costs nothing, the loop looks at each pick and stops
running a request once it is unsure: that saves its forwards. Requests with a grammar, a logit
bias or penalties need their drafts on the host each step, so a batch with any takes the CPU's
loop everywhere.

With `tree_width` > 1 the draft proposes EAGLE-2 dynamic trees instead (draft_tree.py): the same
catch-up forward scores the root's children, then one forward per level expands the likeliest
nodes, for every drafting request at once. The nodes are the draft's top picks (q one-hot), so
tree rejection sampling stays exact; grammar requests have each node masked after its own path,
logit bias and penalties are left to the verify (as the EAGLE-3 head's trees do), and `p_min`
does not apply (a tree's budget goes to its likeliest nodes instead). A draft with a sliding
window drafts chains: a tree's mask hides keys by node, not by window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import device as devices
from engine.model.runner import ForwardInput, ModelRunner
from engine.sample import structured
from engine.sample.sampler import processed_probs, sample, sample_on_device
from engine.sequence import ScheduledSeq, Sequence
from engine.spec_decode.proposers.base import Proposal
from engine.spec_decode.proposers.draft_tree import draft_trees


@dataclass(frozen=True)
class _DraftStep:
    """One forward of the on-device loop: the requests it ran, in row order, and their picks."""

    rows: list[int]  # batch indices
    tokens: torch.Tensor  # [R] long
    probs: torch.Tensor  # [R, draft_vocab]
    sure: torch.Tensor  # [R] bool: the draft's own probability of its pick >= p_min


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner, p_min: float = 0.0, tree_width: int = 1) -> None:
        if runner.is_hybrid:  # its frontier rolls back by position; a recurrent state cannot
            raise ValueError("a hybrid (linear-attention) model cannot be the draft model")
        self.runner = runner
        self.p_min = p_min
        windowed = runner.model.shape.sliding_window is not None
        self.tree_width = 1 if windowed else tree_width  # > 1: EAGLE-2 dynamic trees

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        active = [i for i, item in enumerate(batch) if item.k_for(self.name) > 0]
        if active and self.tree_width > 1:
            return self._propose_trees(batch, active)
        on_device = not devices.host_syncs_free(self.runner.device)
        if active and on_device and all(_plain(batch[i]) for i in active):
            return self._propose_on_device(batch, active)
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

    def _propose_trees(self, batch: list[ScheduledSeq], active: list[int]) -> list[Proposal]:
        """The catch-up forward scores each tree's root; draft_tree.py grows the rest."""
        frontier = {i: batch[i].seq.num_draft_computed_tokens for i in active}
        logits = self.runner.forward([self._catch_up(batch[i], frontier, i) for i in active])
        items = [batch[i] for i in active]
        budgets = [item.k_for(self.name) for item in items]
        trees, held = draft_trees(self.runner, items, budgets, logits, self.tree_width)
        proposals = [Proposal.empty() for _ in batch]
        for i, tree, n in zip(active, trees, held, strict=True):
            if len(tree):
                parents = None if tree.is_chain else tree.parents  # a chain verifies batched
                drafts = list(tree.token_ids)
                proposals[i] = Proposal(drafts, None, self.name, frontier[i] + n, parents)
        return proposals

    def _propose_on_device(self, batch: list[ScheduledSeq], active: list[int]) -> list[Proposal]:
        """Every active request drafts its k; the picks never leave the device until the end."""
        frontier = {i: batch[i].seq.num_draft_computed_tokens for i in active}
        steps: list[_DraftStep] = []
        rows = active
        while rows:
            if not steps:
                logits = self.runner.forward([self._catch_up(batch[i], frontier, i) for i in rows])
            else:
                last = steps[-1]
                picks = last.tokens  # [R]: the last picks are the next forward's tokens
                if rows != last.rows:
                    at = [last.rows.index(i) for i in rows]
                    picks = picks.index_select(0, torch.tensor(at, device=picks.device))
                inputs = [self._feed_last(batch[i], [0], frontier, i) for i in rows]
                logits = self.runner.forward(inputs, picks)  # [R, draft_vocab]
            steps.append(self._draft_on_device(batch, rows, logits, len(steps)))
            rows = [i for i in rows if batch[i].k_for(self.name) > len(steps)]
        drafts, probs = self._to_host(steps)
        return [
            self._proposal(item, drafts.get(i), probs.get(i), frontier.get(i))
            for i, item in enumerate(batch)
        ]

    def _draft_on_device(
        self,
        batch: list[ScheduledSeq],
        rows: list[int],
        logits: torch.Tensor,  # [len(rows), draft_vocab]
        num_drafted: int,  # drafts each of these rows has made before this one
    ) -> _DraftStep:
        seqs = [batch[i].seq for i in rows]
        params = [seq.params for seq in seqs]
        step_probs = processed_probs(logits, params, [[] for _ in rows])  # no penalties here
        row_keys = [_row_key(seq, num_drafted) for seq in seqs]  # seeded: this position's noise
        tokens = sample_on_device(step_probs, [p.greedy for p in params], row_keys)
        # Confidence uses the raw draft distribution, so greedy (one-hot) rows are judged too.
        confidence = torch.softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        return _DraftStep(rows, tokens, step_probs, confidence >= self.p_min)

    @staticmethod
    def _to_host(
        steps: list[_DraftStep],
    ) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
        """Each request's drafts up to and including its first unsure pick, and their probs; the
        step's one device-to-host copy of the draft loop."""
        flat = torch.cat([s.tokens for s in steps] + [s.sure.long() for s in steps]).tolist()
        num = len(flat) // 2
        tokens, sure = flat[:num], flat[num:]
        drafts: dict[int, list[int]] = {i: [] for i in steps[0].rows}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in steps[0].rows}
        stopped: set[int] = set()
        offset = 0
        for step in steps:
            for r, i in enumerate(step.rows):
                if i not in stopped:
                    drafts[i].append(tokens[offset + r])
                    probs[i].append(step.probs[r])
                    if not sure[offset + r]:
                        stopped.add(i)
            offset += len(step.rows)
        return drafts, probs

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


def _plain(item: ScheduledSeq) -> bool:
    """Drafts that need no host look per token: no grammar or logit bias, no penalties."""
    return item.seq.constraint is None and not item.seq.params.has_penalties
