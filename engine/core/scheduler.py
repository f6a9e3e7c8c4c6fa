"""Continuous batching: FCFS admission, token and sequence budgets, chunked prefill, preemption.

There are no prefill and decode phases: each running request schedules the tokens it has not computed
yet (a prompt chunk, or its last sampled token) plus room for up to k speculative tokens once its chunk
reaches the end of the known tokens. When blocks run out the newest running request is preempted and
later recomputed from scratch; nothing is dropped.

A hybrid target (linear-attention layers) with prefix caching resumes only from a prefix whose
state was snapshotted (engine/core/state_cache.py): its hits are cut to such a prefix, and its
prompt chunks end at the boundary where its own snapshot is taken.
"""

from __future__ import annotations

import time
from collections import deque

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.state_cache import StateSnapshots
from engine.model.state_pool import StateCommit, StateRestore
from engine.outputs import TokenLogprob
from engine.sample import structured
from engine.sample.sampling_params import SamplingParams
from engine.sequence import ScheduledSeq, SchedulerOutput, SeqResult, Sequence, SequenceStatus
from engine.spec_decode.planner import SpecPlanner

Stop = tuple[str, int | str | None]  # (finish reason, stop reason)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        planner: SpecPlanner | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        num_state_slots: int = 0,  # a hybrid target's: one recurrent-state slot per running request
        num_state_snapshots: int = 0,  # a hybrid target's prefix-cache state snapshots
    ) -> None:
        self.config = config
        self.planner = planner
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))
        self.uses_state_slots = num_state_slots > 0
        cached_states = num_state_slots > 0 and num_state_snapshots > 0
        caching = cached_states and block_manager.enable_prefix_caching
        self.snapshots = StateSnapshots(num_state_snapshots) if caching else None
        self._restores: list[StateRestore] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        num_preempted = 0
        step_k = self._step_k()
        # Running requests first (decodes before prefills, so a long prompt never stalls them).
        for seq in sorted(list(self.running), key=lambda s: s.num_uncomputed_tokens > 1):
            if seq not in self.running or budget <= 0:
                continue
            item = self._plan(seq, budget, step_k)
            while not self.blocks.grow(seq.block_table, self._positions(item)):
                victim = self.running[-1]
                self._preempt(victim)
                num_preempted += 1
                budget += sum(_cost(s) for s in scheduled if s.seq is victim)  # hand it back
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            scheduled.append(item)
            budget -= _cost(item)
        scheduled = [s for s in scheduled if s.seq.status == SequenceStatus.RUNNING]
        # Then admit waiting requests, oldest first, while budgets and blocks allow; not in a step
        # that had to preempt (blocks are short: admitting now would only preempt again).
        while (
            not num_preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            admitted = self._admit(self.waiting[0], budget, step_k)
            if admitted is None:
                break
            self.waiting.popleft()
            scheduled.append(admitted)
            budget -= _cost(admitted)
        restores, self._restores = self._restores, []
        return SchedulerOutput(scheduled, num_preempted, restores)

    def update_from_output(self, item: ScheduledSeq, result: SeqResult) -> int:
        """The one place a step's outcome changes a request: its tokens appended and its stop
        decided, its progress advanced. Rejected drafts are rolled back by not counting them: only
        the accepted drafts' K/V count as computed. Returns the tokens emitted."""
        seq = item.seq
        self._record_prompt_logprobs(seq, result.prompt_logprobs)
        num_emitted, stop = self._append(seq, result) if item.reaches_end else (0, None)
        seq.num_computed_tokens += item.num_new_tokens + result.num_accepted
        if result.num_draft_computed is not None:
            seq.num_draft_computed_tokens = result.num_draft_computed
        seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, seq.num_computed_tokens)
        if self.planner is not None and item.reaches_end:
            k = item.k_for(result.proposer)
            state = self.planner.state_of(seq)
            self.planner.observe(state, result.proposer, k, result.num_accepted)
        self._cache_blocks(seq)
        if stop is not None:
            self.finish(seq, *stop)
        return num_emitted

    def request_k(self, params: SamplingParams) -> int:
        """A request's own k: the server's, capped by the request's `num_speculative_tokens`."""
        spec = self.config.speculative
        k = spec.num_speculative_tokens if spec.enabled else 0
        return k if params.num_speculative_tokens is None else min(k, params.num_speculative_tokens)

    def _append(self, seq: Sequence, result: SeqResult) -> tuple[int, Stop | None]:
        """Append a verified run token by token; a stop inside the run cuts it there. Returns the
        tokens appended and the stop, if one was hit."""
        seq.spec.add(result.num_drafts, result.num_accepted, result.proposer)
        if seq.times.first_token is None:
            seq.times.first_token = time.monotonic()
        for i, token in enumerate(result.tokens):
            seq.token_ids.append(token)
            seq.pending_token_ids.append(token)
            if result.logprobs is not None:
                seq.pending_logprobs.append(result.logprobs[i])
            if seq.params.token_origins:
                seq.origins.append(result.origin(i))
            stop = self._stop(seq, token)
            if stop is not None:
                return i + 1, stop
        return len(result.tokens), None

    def _stop(self, seq: Sequence, token: int) -> Stop | None:
        """Length is checked once, at admission (prompt + max_tokens fits the context window), so
        max_tokens is the only length a request can reach."""
        params = seq.params
        stop_string = seq.detokenizer.append(token)
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if stop_string is not None:
            return "stop", stop_string
        if structured.advance(seq.constraint, token):  # the grammar is complete
            return "stop", None
        if seq.num_output_tokens >= params.max_tokens:
            return "length", None
        return None

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, new: list[TokenLogprob]) -> None:
        if not seq.wants_prompt_logprobs:
            return
        seq.prompt_logprobs.extend(new)
        if len(seq.prompt_logprobs) >= seq.num_prompt_tokens:
            seq.prompt_logprobs_done = True

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Mark a request finished (stop, length, abort) and return its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.times.finished = time.monotonic()
        if self.planner is not None:
            self.planner.finished(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)
        self._release_state_slot(seq)

    def _cache_blocks(self, seq: Sequence) -> None:
        """Share computed full blocks; flag those whose draft K/V are computed too."""
        self.blocks.cache_full_blocks(
            seq.token_ids, seq.block_table, seq.block_hashes, seq.num_computed_tokens
        )
        seq.num_draft_cached_blocks = self.blocks.mark_draft_computed(
            seq.block_table, seq.num_draft_cached_blocks, seq.num_draft_computed_tokens
        )

    def _step_k(self) -> int:
        """The most drafts any request may get this step (its own k caps it further)."""
        spec = self.config.speculative
        limit = spec.disable_by_batch_size
        if not spec.enabled or (limit and len(self.running) > limit):
            return 0
        return spec.num_speculative_tokens

    def _plan(self, seq: Sequence, budget: int, step_k: int) -> ScheduledSeq:
        n = min(seq.num_uncomputed_tokens, budget)
        for boundary in seq.state_snapshot_at:  # the chunk ends where a snapshot is taken
            if seq.num_computed_tokens < boundary < seq.num_computed_tokens + n:
                n = boundary - seq.num_computed_tokens
        item = ScheduledSeq(seq, n, 0)
        if not item.reaches_end:
            return item
        # Room left: the final emitted token is always the target's own, so at most
        # max_tokens - outputs - 1 drafts, and never past the context window.
        room = min(
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
            budget - n,
        )
        names = self.config.speculative.proposers
        k = self._request_k(seq, step_k)
        item.spec_k = {name: max(0, min(k, room)) for name in names} if k else {}
        if item.num_prompt_tokens > 0 and seq.num_tokens - seq.num_draft_computed_tokens > 32:
            # No draft-model forward in the step that finishes a long prompt: the draft would prefill
            # it first and delay the first token. It catches up in the next step instead.
            item.spec_k.pop("draft", None)
        # Tokens the grammar forces are free, always-right drafts: room for them whatever k says.
        forced = structured.forced_tokens(seq.constraint, min(seq.num_speculative_tokens, room))
        if forced:
            item.spec_k[structured.FORCED_SOURCE] = len(forced)
        item.num_spec_tokens = max(item.spec_k.values(), default=0)
        return item

    def _request_k(self, seq: Sequence, step_k: int) -> int:
        """The most drafts this request may get this step, from any proposer (the planner picks
        how many it does get)."""
        return min(seq.num_speculative_tokens, step_k)

    def _positions(self, item: ScheduledSeq) -> int:
        return item.seq.num_computed_tokens + item.num_new_tokens + item.num_spec_tokens

    def _resumable(self, seq: Sequence, cached: list[int]) -> tuple[list[int], int | None]:
        """A hybrid's hit cut to its deepest block with a state snapshot, and that snapshot's
        row (None: no snapshot). Sets where its prefill snapshots its own state: at the end of
        the K/V prefix it shares with earlier requests where that is deeper than the hit (a
        shared system prompt), and at its prompt's last full block before its last token (the
        deepest a later request with this prompt as its prefix can match)."""
        if self.snapshots is None:
            return cached, None
        depth, row = self.snapshots.deepest(self.blocks.chain_hashes(seq.token_ids, len(cached)))
        size = self.blocks.block_size
        last = (seq.num_prompt_tokens - 1) // size * size
        shared = len(cached) * size if len(cached) > depth else 0
        seq.state_snapshot_at = tuple(sorted({b for b in (shared, last) if b > depth * size}))
        return cached[:depth], row

    def _admit(self, seq: Sequence, budget: int, step_k: int) -> ScheduledSeq | None:
        cached = [] if seq.wants_prompt_logprobs else self.blocks.match_prefix(seq.token_ids)
        cached, snapshot = self._resumable(seq, cached)
        num_cached = len(cached) * self.blocks.block_size
        seq.num_computed_tokens = num_cached
        # The draft's K/V are valid only on the leading blocks some request's draft computed, and
        # one position short of them: a head keeps position p's K/V in p + 1's slot, beside the
        # token it read (engine/model/head_kv.py), so the last one is in a block not shared.
        drafted = self.blocks.num_draft_computed(cached) * self.blocks.block_size
        seq.num_draft_computed_tokens = max(0, drafted - 1)
        item = self._plan(seq, budget, step_k)
        needed = self.blocks.blocks_needed(self._positions(item)) - len(cached)
        if not self.blocks.can_allocate(needed + self.blocks.num_free_among(cached)):
            seq.reset_progress()
            return None
        self.blocks.acquire(cached)
        seq.block_table = list(cached)
        seq.block_hashes = (
            [] if not cached else self.blocks.chain_hashes(seq.token_ids, len(cached))
        )
        seq.num_draft_cached_blocks = seq.num_draft_computed_tokens // self.blocks.block_size
        self.blocks.grow(seq.block_table, self._positions(item))
        if seq.times.first_scheduled is None:
            seq.num_cached_tokens = num_cached
            self.blocks.record_lookup(seq.num_prompt_tokens, num_cached)
            seq.times.first_scheduled = time.monotonic()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if self.uses_state_slots:
            seq.state_slot = self.free_state_slots.pop()  # as many as max_num_seqs: one is free
            if snapshot is not None and self.snapshots is not None:  # a hybrid's prefix hit
                self._restores.append(StateRestore(snapshot, seq.state_slot))
                self.snapshots.num_hits += 1
        return item

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV, keep the tokens, go back to the front of the queue."""
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        self._release_state_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.reset_progress()
        self.waiting.appendleft(seq)

    def _release_state_slot(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None

    def state_commits(self, batch: list[ScheduledSeq]) -> list[StateCommit]:
        """After update_from_output: each running request's progress, for the runner to keep the
        recurrent state at its last accepted token (a hybrid target's rollback)."""
        return [
            StateCommit(item.seq.state_slot, item.seq.num_computed_tokens, self._snapshot(item))
            for item in batch
            if item.seq.state_slot is not None
        ]

    def _snapshot(self, item: ScheduledSeq) -> int | None:
        """The snapshot row to keep the request's state in, where this step's chunk ended at one
        of its snapshot boundaries (`_plan` ends it there); else None."""
        seq = item.seq
        done = seq.num_computed_tokens
        if self.snapshots is None or not item.num_new_tokens or done not in seq.state_snapshot_at:
            return None
        return self.snapshots.reserve(seq.block_hashes[done // self.blocks.block_size - 1])


def _cost(item: ScheduledSeq) -> int:
    """Tokens an item takes from the step's budget."""
    return item.num_new_tokens + item.num_spec_tokens
