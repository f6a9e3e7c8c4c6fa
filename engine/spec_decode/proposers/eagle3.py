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
draft, the projections batched and the attention per request. The head's K/V lives in the target's
KV slots (engine/model/head_kv.py) and its frontier is the request's `num_draft_computed_tokens`,
as a draft model's: this proposer returns it in the Proposal and the scheduler applies it, resets
it on preemption and starts it past a cached prefix whose head K/V some request computed. Drafts
write positions past the frontier, which the next catch-up overwrites: rejected drafts are rolled
back by not advancing.

A long prompt is caught up chunk by chunk: in each step of its prefill the head runs over the
chunks the target computed before (in the same forward as the drafting requests' catch-ups), so
its first drafting step catches up on the last chunk only, not on the whole prompt.

Greedy drafts are the argmax; sampled ones are drawn from the head's distribution after the
request's own sampling parameters, over the target's vocabulary (zero outside the draft
vocabulary), so rejection sampling stays exact; seeded ones with the noise of the position they
fill, as the draft model does.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Protocol

import torch

from engine.model import device as devices
from engine.model.device import TimingMark, drain_timings, start_timing, stop_timing
from engine.model.head_kv import HeadCache, HeadKV, HeadKVPool, HeadSpan
from engine.model.runner import ModelRunner
from engine.sample import structured
from engine.sample.sampler import processed_probs, sample
from engine.sequence import ScheduledSeq, Sequence
from engine.spec_decode.proposers.base import Proposal, picked_proposal, still_drafting
from engine.spec_decode.proposers.eagle3_tree import draft_trees


class FeatureHead(Protocol):
    """A one-layer head that drafts from the target's kept hidden states: an EAGLE-3 head
    (engine/model/eagle3.py) or Qwen3.5's MTP layer (engine/model/mtp.py)."""

    @property
    def feature_width(self) -> int: ...  # the width of the target's kept features a row reads

    @property
    def device(self) -> torch.device: ...

    def new_cache(self) -> HeadCache: ...

    def fuse(self, features: torch.Tensor) -> torch.Tensor: ...  # [T, feature_width] -> [T, hidden]

    def __call__(
        self, hidden: torch.Tensor, token_ids: torch.Tensor, spans: list[HeadSpan]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...  # normed, the next step's hidden

    def logits(self, normed: torch.Tensor) -> torch.Tensor: ...  # [N, hidden] -> [N, vocab]


class Eagle3Proposer:
    name = "eagle3"

    def __init__(self, head: FeatureHead, target: ModelRunner, tree_width: int = 1) -> None:
        self.head = head
        self.target = target  # keeps the aux hidden states the head reads
        self.tree_width = tree_width  # > 1: EAGLE-2 dynamic trees (eagle3_tree.py)
        self.pool: HeadKVPool | None = None  # the head's K/V by KV slot (allocate)
        # (rows, start, stop) of each head forward since the engine last took them; None: not
        # timed (the draft model's runner keeps the same record, ModelRunner.timings)
        self.timings: list[tuple[int, TimingMark, TimingMark]] | None = None

    @property
    def kv_bytes_per_slot(self) -> int:
        """What the head's K/V adds to each position of the KV pool."""
        return HeadKVPool.bytes_per_slot(self.head.new_cache())

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The head's K/V beside the target's, for the same block ids."""
        self.pool = HeadKVPool(self.head.new_cache(), num_blocks * block_size, block_size)

    @torch.inference_mode()
    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        """All drafting requests together: one head forward for their catch-ups (which drafts
        each one's first token, and catches prefilling requests up on their earlier chunks),
        then one per further draft over those still drafting."""
        active = [i for i, item in enumerate(batch) if self._drafts(item)]
        behind = [i for i, item in enumerate(batch) if self._prefills_behind(item)]
        if not active and not behind:
            return [Proposal.empty() for _ in batch]
        rows = active + behind  # the drafting ones first: the catch-up's logits are theirs
        caches = {i: self._cache(batch[i]) for i in rows}
        seqs = [batch[i].seq for i in rows]
        logits, hidden = self._catch_up(seqs, [caches[i] for i in rows], len(active))
        frontiers = {i: batch[i].seq.num_computed_tokens for i in rows}
        if self.tree_width > 1 and active:
            proposals = self._trees(batch, active, [caches[i] for i in active], logits, hidden)
        else:
            proposals = self._chains(batch, active, caches, logits, hidden)
        return [
            dataclasses.replace(p, num_draft_computed=frontiers[i]) if i in frontiers else p
            for i, p in enumerate(proposals)
        ]

    def _chains(
        self,
        batch: list[ScheduledSeq],
        rows: list[int],  # the drafting requests
        caches: dict[int, HeadKV],
        logits: torch.Tensor,  # [len(rows), vocab] their catch-ups' last rows
        hidden: torch.Tensor,  # [len(rows), hidden]
    ) -> list[Proposal]:
        """Each drafting request's chain: one head forward per draft after the catch-up's."""
        drafts: dict[int, list[int]] = {i: [] for i in rows}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in rows}
        step = 0
        while rows:
            if step > 0:  # the head's own output and each row's last draft, one position further
                spans = [
                    HeadSpan(caches[i], batch[i].seq.num_computed_tokens + step - 1, 1)
                    for i in rows
                ]
                tokens = self._ids([drafts[i][-1] for i in rows])
                logits, hidden = self._run(hidden, tokens, spans)
            drafted = pick_drafts(batch, rows, logits, drafts, probs)
            step += 1
            keep = still_drafting(batch, rows, drafted, step, self.name)
            rows, hidden = [rows[r] for r in keep], hidden[keep]
        return [
            picked_proposal(item, drafts.get(i), probs.get(i), self.name)
            for i, item in enumerate(batch)
        ]

    def _trees(
        self,
        batch: list[ScheduledSeq],
        rows: list[int],  # the drafting requests
        caches: list[HeadKV],
        logits: torch.Tensor,  # [len(rows), vocab] their catch-ups' last rows
        hidden: torch.Tensor,  # [len(rows), hidden]
    ) -> list[Proposal]:
        items = [batch[i] for i in rows]
        budgets = [item.k_for(self.name) for item in items]
        trees = draft_trees(
            lambda h, ids, spans: self._run(h, self._ids(ids), spans),
            self.head.new_cache,
            items,
            budgets,
            caches,
            logits,
            hidden,
            self.tree_width,
        )
        proposals = [Proposal.empty() for _ in batch]
        for i, tree in zip(rows, trees, strict=True):
            parents = None if tree.is_chain else tree.parents  # a chain verifies batched
            proposals[i] = Proposal(list(tree.token_ids), None, self.name, parents=parents)
        return proposals

    def _drafts(self, item: ScheduledSeq) -> bool:
        """Whether the request drafts this step: the head needs the target's features of every
        token before the last, so only a step that computes just the last one drafts."""
        return (
            item.k_for(self.name) > 0
            and item.num_new_tokens == 1
            and item.seq.num_computed_tokens > 0
        )

    @staticmethod
    def _prefills_behind(item: ScheduledSeq) -> bool:
        """A later chunk of a prompt (or of a recompute) whose earlier chunks the head has not
        seen: it catches up on them now, so that its first drafting step need not."""
        seq = item.seq
        return item.num_new_tokens > 1 and seq.num_draft_computed_tokens < seq.num_computed_tokens

    def _cache(self, item: ScheduledSeq) -> HeadKV:
        assert self.pool is not None, "allocate the head's K/V first"
        return self.pool.cache(item.seq.block_table)

    def _catch_up(
        self, seqs: list[Sequence], caches: list[HeadKV], num_drafting: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over the computed positions each request's head has not seen (at least the
        last one, for the first `num_drafting` requests, which draft from it); returns the
        drafting requests' last rows: logits [num_drafting, vocab], prenorm [num_drafting, hidden]."""
        spans, aux, tokens = [], [], []
        for r, (seq, cache) in enumerate(zip(seqs, caches, strict=True)):
            end = seq.num_computed_tokens
            start = seq.num_draft_computed_tokens
            if r < num_drafting:
                start = min(start, end - 1)
            spans.append(HeadSpan(cache, start, end - start))
            # [end - start, 3 * target_hidden], and the token after each position
            aux.append(self.target.aux_hidden(seq.block_table, start, end))
            tokens += seq.token_ids[start + 1 : end + 1]
        ends = torch.tensor([span.length for span in spans]).cumsum(0) - 1
        return self._run(torch.cat(aux), self._ids(tokens), spans, ends[:num_drafting], fuse=True)

    def _run(
        self,
        hidden: torch.Tensor,  # [T, hidden], or the target's features [T, 3 * target_hidden]
        tokens: torch.Tensor,  # [T]
        spans: list[HeadSpan],
        last: torch.Tensor | None = None,  # [R]: the rows that draft; None: all
        fuse: bool = False,  # hidden holds the target's features: fc fuses them first
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [R, vocab], prenorm [R, hidden]
        """One head forward, timed where the engine asks (its cost curve is the draft's)."""
        device = self.head.device
        started = start_timing(device) if self.timings is not None else None
        normed, prenorm = self.head(self.head.fuse(hidden) if fuse else hidden, tokens, spans)
        if last is not None:
            normed, prenorm = normed[last], prenorm[last]
        logits = self.head.logits(normed)
        if self.timings is not None and started is not None:
            self.timings.append((tokens.shape[0], started, stop_timing(device)))
        return logits, prenorm

    def take_timings(self) -> list[tuple[int, float]]:
        """(rows, seconds) of each timed head forward since the last call."""
        return drain_timings(self.timings)

    def calibrate(self, rows: list[int], rounds: int = 3) -> list[tuple[int, float]]:
        """(rows, seconds) of a head forward with its logits at each row count, the median of
        `rounds` after a warm-up, on a scratch cache: before any request runs."""
        width = self.head.feature_width
        measured = []
        for m in rows:
            features = torch.zeros(m, width, device=self.head.device)
            tokens, seconds = self._ids([0] * m), []
            for _ in range(rounds + 1):
                devices.synchronize(self.head.device)
                t0 = time.perf_counter()
                self._run(features, tokens, [HeadSpan(self.head.new_cache(), 0, m)], fuse=True)
                devices.synchronize(self.head.device)
                seconds.append(time.perf_counter() - t0)
            measured.append((m, statistics.median(seconds[1:])))
        return measured

    def _ids(self, token_ids: list[int]) -> torch.Tensor:  # [T] long on the head's device
        return torch.tensor(token_ids, dtype=torch.long, device=self.head.device)


def pick_drafts(
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


class MtpProposer(Eagle3Proposer):
    """Qwen3.5's own MTP layer, driven as an EAGLE-3 head: it reads the target's final hidden
    state where EAGLE-3 reads three layers' streams (`speculative_method: mtp`)."""

    name = "mtp"
