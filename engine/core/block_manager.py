"""KV block bookkeeping: free list, reference counts and the prefix cache. Pure Python, no tensors.

A block is a fixed run of `block_size` token positions in every layer's KV pool. A full block is keyed
by a hash of its tokens chained with its parent's key, so two requests with a common prompt prefix
share those blocks by reference count. A freed block keeps its key until it is reused, so a later
request with the same prefix can still find it (least recently freed blocks are reused first).

A draft model keeps its own KV pool on the same block ids, but a cached block holds the draft's K/V
only if some request's draft computed them: `_draft_computed` says which. A request that reuses a
cached prefix starts its draft at the first block the draft never computed and catches up from there.
"""

from __future__ import annotations

from collections import OrderedDict

BlockKey = tuple[int | None, tuple[int, ...]]  # (parent block's hash, the block's tokens)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._key_of: dict[int, BlockKey] = {}  # block id -> its key, for cached full blocks
        self._block_of: dict[BlockKey, int] = {}  # key -> block id
        self._draft_computed: set[int] = set()  # cached blocks whose draft K/V are valid
        self.num_hit_queries = 0  # prompt tokens looked up in the prefix cache, ever
        self.num_hit_tokens = 0  # of those, found
        self._reported = (0, 0)  # totals at the last take_lookup_stats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Cached blocks holding a prefix of `token_ids`; the last token is always left to compute."""
        if not self.enable_prefix_caching:
            return []
        blocks: list[int] = []
        parent: int | None = None
        num_full = (len(token_ids) - 1) // self.block_size
        for i in range(num_full):
            key = (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
            parent = hash(key)
        return blocks

    def chain_hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        """The chain hashes of the first num_blocks full blocks of token_ids."""
        hashes: list[int] = []
        parent: int | None = None
        for i in range(num_blocks):
            parent = hash(
                (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            )
            hashes.append(parent)
        return hashes

    def num_draft_computed(self, blocks: list[int]) -> int:
        """How many leading blocks of a matched prefix also hold the draft's K/V."""
        n = 0
        while n < len(blocks) and blocks[n] in self._draft_computed:
            n += 1
        return n

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on blocks found by match_prefix."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def num_free_among(self, blocks: list[int]) -> int:
        """How many of these (prefix-cache) blocks would leave the free list if acquired."""
        return sum(1 for block in blocks if self._ref_counts[block] == 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def grow(self, block_table: list[int], num_positions: int) -> bool:
        """Extend block_table in place to cover num_positions; False (and no change) if out of blocks."""
        missing = self.blocks_needed(num_positions) - len(block_table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        for _ in range(missing):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._ref_counts[block] = 1
            block_table.append(block)
        return True

    def release(self, block_table: list[int]) -> None:
        """Drop a request's references; unreferenced blocks go back to the free list, keys kept."""
        for block in reversed(
            block_table
        ):  # tail blocks are reused first: they are least shareable
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._key_of:
                    self._free.move_to_end(block, last=False)
        block_table.clear()

    def cache_full_blocks(
        self,
        token_ids: list[int],
        block_table: list[int],
        block_hashes: list[int],  # the request's registered blocks' chain hashes; extended in place
        num_computed: int,
    ) -> None:
        """Register the full blocks whose K/V are computed, resuming after the last registered one."""
        if not self.enable_prefix_caching:
            return
        parent = block_hashes[-1] if block_hashes else None
        num_full = min(num_computed, len(token_ids)) // self.block_size
        for i in range(len(block_hashes), min(num_full, len(block_table))):
            key = (parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            block = block_table[i]
            if self._key_of.get(block) != key and key not in self._block_of:
                self._forget(block)
                self._key_of[block] = key
                self._block_of[key] = block
            parent = hash(key)
            block_hashes.append(parent)

    def mark_draft_computed(self, block_table: list[int], start: int, num_computed: int) -> int:
        """Flag the cached blocks in [start, num_computed // block_size) as holding draft K/V;
        returns the new start (blocks flagged so far)."""
        end = min(num_computed // self.block_size, len(block_table))
        for block in block_table[start:end]:
            if block in self._key_of:
                self._draft_computed.add(block)
        return max(start, end)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_hit_queries += num_queried
        self.num_hit_tokens += num_hit

    def take_lookup_stats(self) -> tuple[int, int]:
        """(queried, hit) prompt tokens since the last call: per-step deltas for the metrics."""
        queried, hit = self._reported
        self._reported = (self.num_hit_queries, self.num_hit_tokens)
        return self.num_hit_queries - queried, self.num_hit_tokens - hit

    def _forget(self, block: int) -> None:
        self._draft_computed.discard(block)
        key = self._key_of.pop(block, None)
        if key is not None and self._block_of.get(key) == block:
            del self._block_of[key]
