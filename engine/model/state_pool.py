"""The recurrent states of a hybrid model's linear-attention layers, one slot per running request.

K/V are addressed by position, so a rejected draft is rolled back by not counting it. A recurrent
state is not: it is one tensor that every token overwrites. So a verify keeps the state after each
of its last token and drafts (the candidates) beside the slot, leaves the slot itself as it was,
and `commit` copies in the candidate at the request's last accepted token once the scheduler has
decided it. A forward without drafts (a prompt chunk, a plain decode) writes its final state into
the slot directly. A request starting at position 0 starts from zeros whatever its slot held
(a new request, or a preempted one recomputing), so slots need no clearing.

The scheduler hands out the slot ids (`Sequence.state_slot`), as the block manager hands out
block ids; this pool owns the tensors. A forward input without a slot (the start-up timing
forwards) uses a scratch slot of its own.

With prefix caching, the pool also keeps a few snapshots: a slot's state copied out at a block
boundary (`StateCommit.snapshot`), copied back into a newly admitted request's slot
(`StateRestore`) so that its prefill resumes there. The scheduler's `StateSnapshots`
(engine/core/state_cache.py) says which snapshot row holds which prefix; this pool only copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateCommit:
    """After accept: the request in `slot` has `num_computed` tokens; its state is the one after
    its last computed token."""

    slot: int
    num_computed: int
    snapshot: int | None = None  # then copy that state into this snapshot row too


@dataclass(frozen=True)
class StateRestore:
    """Before a forward: a newly admitted request resumes in `slot` from snapshot row `snapshot`."""

    snapshot: int
    slot: int


@dataclass(frozen=True)
class StateSegment:
    """One request's tokens in a forward's flat batch."""

    row: int  # its first row in the batch
    num_tokens: int
    slot: int  # its slot in the pool
    start_pos: int  # tokens computed before this forward (0: start from zeros)
    num_candidates: int  # its last token plus drafts when it verifies drafts, else 0


@dataclass
class _Candidates:
    first: int  # the tokens computed at candidate 0 (its last token accepted, no draft)
    states: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per linear layer: conv [c, ...], recurrent [c, ...]


class StatePool:
    def __init__(
        self,
        conv_shape: tuple[int, ...],  # a request's conv state in one layer: [conv_dim, kernel - 1]
        recurrent_shape: tuple[int, ...],  # its recurrent state: [v_heads, k_dim, v_dim]
        num_layers: int,  # linear-attention layers
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,  # the model's: the conv state holds projections in it
        num_snapshots: int = 0,  # prefix-cache snapshots kept beside the slots
    ) -> None:
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        # rows [0, num_slots): the slots; then a scratch slot, for forwards without a slot; then
        # the snapshots
        rows = num_slots + 1 + num_snapshots
        self.conv = [
            torch.zeros(rows, *conv_shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # float32 as transformers keeps it: every token rescales it, rounding would accumulate
        self.recurrent = [
            torch.zeros(rows, *recurrent_shape, device=device) for _ in range(num_layers)
        ]
        self.pending: dict[int, _Candidates] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.conv + self.recurrent)

    def restore(self, restores: list[StateRestore]) -> None:
        """Fill each newly admitted request's slot from its prefix's snapshot."""
        for r in restores:
            self._copy(self._snapshot_row(r.snapshot), r.slot)

    def _snapshot_row(self, snapshot: int) -> int:
        if not 0 <= snapshot < self.num_snapshots:
            raise ValueError(f"no snapshot row {snapshot} (the pool keeps {self.num_snapshots})")
        return self.num_slots + 1 + snapshot

    def _copy(self, src: int, dst: int) -> None:
        for conv, recurrent in zip(self.conv, self.recurrent, strict=True):
            conv[dst].copy_(conv[src])
            recurrent[dst].copy_(recurrent[src])

    def batch(self, segments: list[StateSegment]) -> StateBatch:
        self.pending = {}  # a verify whose candidates were never committed is forgotten
        return StateBatch(self, segments)

    def commit(self, commits: list[StateCommit]) -> None:
        """Put each verified request's state at its last accepted token into its slot."""
        for commit in commits:
            self._commit_one(commit)
            if commit.snapshot is not None:
                self._copy(commit.slot, self._snapshot_row(commit.snapshot))
        self.pending = {}

    def _commit_one(self, commit: StateCommit) -> None:
        found = self.pending.get(commit.slot)
        if found is not None:  # else no drafts this step: its slot already holds its state
            j = commit.num_computed - found.first
            if not 0 <= j < len(found.states[0][0]):
                raise ValueError(
                    f"slot {commit.slot}: {commit.num_computed} tokens, no such candidate"
                )
            for layer, (conv, recurrent) in enumerate(found.states):
                self.conv[layer][commit.slot].copy_(conv[j])
                self.recurrent[layer][commit.slot].copy_(recurrent[j])


class StateBatch:
    """One forward's requests and their slots, as the linear layers read and write them."""

    def __init__(self, pool: StatePool, segments: list[StateSegment]) -> None:
        self.pool = pool
        self.segments = segments

    def read(
        self, layer: int, seg: StateSegment
    ) -> tuple[torch.Tensor, torch.Tensor]:  # conv [conv_dim, kernel - 1], recurrent [h, k, v]
        conv, recurrent = self.pool.conv[layer][seg.slot], self.pool.recurrent[layer][seg.slot]
        if seg.start_pos == 0:
            return torch.zeros_like(conv), torch.zeros_like(recurrent)
        return conv, recurrent

    def write(
        self,
        layer: int,
        seg: StateSegment,
        conv: torch.Tensor,  # [kept, conv_dim, kernel - 1]: after each candidate, or the last
        recurrent: torch.Tensor,  # [kept, v_heads, k_dim, v_dim]
    ) -> None:
        if not seg.num_candidates:
            self.pool.conv[layer][seg.slot].copy_(conv[-1])
            self.pool.recurrent[layer][seg.slot].copy_(recurrent[-1])
            return
        first = seg.start_pos + seg.num_tokens - seg.num_candidates + 1
        found = self.pool.pending.setdefault(seg.slot, _Candidates(first, []))
        assert len(found.states) == layer, "linear layers write their candidates in order"
        found.states.append((conv, recurrent))

    @classmethod
    def segments_of(
        cls,
        inputs: list[tuple[int, int, int | None, int]],  # (tokens, start_pos, slot, drafts) each
        scratch: int,
    ) -> list[StateSegment]:
        segments, row = [], 0
        for num_tokens, start_pos, slot, drafts in inputs:
            slot_id = scratch if slot is None else slot
            segments.append(
                StateSegment(row, num_tokens, slot_id, start_pos, drafts + 1 if drafts else 0)
            )
            row += num_tokens
        return segments
