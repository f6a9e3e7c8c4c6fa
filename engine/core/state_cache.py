"""Which prefixes a hybrid target's state snapshots hold: prefix caching for linear attention.

A cached K/V block of a hybrid model (Qwen3.5) is not enough to resume from: its linear layers
need their recurrent and conv state after the block's last token, and a request's state is one
tensor that every token overwrites (a real Qwen3.5 state is ~49 MiB, so not one per block). So
the runner's `StatePool` keeps a bounded number of snapshots, and this index, owned by the
scheduler as the block manager owns block ids, maps the chain hash of the block a snapshot ends
at (`BlockManager.chain_hashes`) to its row, least recently used evicted first.

The scheduler snapshots each prompt at its last full block before its last token (the deepest
boundary a later request with that prompt as its prefix can match) and at the end of its K/V
prefix match where that ran deeper than any snapshot (a prefix shared with earlier requests): it
ends a prompt chunk at each and the state after that chunk is copied out (`StateCommit.snapshot`). On admission a hybrid
request's prefix-cache hit is cut to the deepest matched block that has a snapshot, which is
copied into its slot (`StateRestore`) before the forward that continues its prefill.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._row_of: OrderedDict[int, int] = OrderedDict()  # chain hash -> snapshot row, LRU first
        self._free = list(range(capacity - 1, -1, -1))
        self.num_hits = 0  # admissions that resumed from a snapshot, ever
        self.num_saved = 0  # snapshots taken, ever

    def __len__(self) -> int:
        return len(self._row_of)

    def deepest(self, hashes: list[int]) -> tuple[int, int | None]:
        """(blocks, row): the longest prefix of these chain hashes with a snapshot, and its row;
        (0, None) without one."""
        for depth in range(len(hashes), 0, -1):
            row = self._row_of.get(hashes[depth - 1])
            if row is not None:
                self._row_of.move_to_end(hashes[depth - 1])
                return depth, row
        return 0, None

    def reserve(self, key: int) -> int:
        """The row to save the snapshot ending at chain hash `key` into (its own if it has one,
        else a free row, else the least recently used one's)."""
        self.num_saved += 1
        row = self._row_of.pop(key, None)
        if row is None:
            row = self._free.pop() if self._free else self._row_of.popitem(last=False)[1]
        self._row_of[key] = row
        return row
