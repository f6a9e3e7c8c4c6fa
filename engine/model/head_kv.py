"""The K/V of a one-layer draft head (an EAGLE-3 head, Qwen3.5's MTP layer), addressed by position.

A request's head K/V lives in the target's KV slots (`HeadKVPool`): slot q of a request is
block_table[q // block_size] * block_size + q % block_size, as for its target K/V and kept
features. So the head's K/V is sized with the KV pool, freed and preempted with the request's
blocks, and shared by the prefix cache: a request whose prompt starts with a cached prefix finds
the head's K/V of those blocks too, where the head had computed them (the block manager's draft
marks, as for a draft model), and the head catches up only on the rest.

The head's row at position p reads the target's features of p and the token at p + 1, so its K/V
is kept in slot p + 1, beside that token: then a slot's K/V depends only on the tokens up to it,
as a block's hash does, and requests sharing a block agree on every slot of it. (In slot p it
would depend on a token of the next block, which two requests sharing this one may not share.)

Positions past the head's frontier hold drafts' K/V, overwritten by the next catch-up: rejected
drafts are rolled back by not advancing the frontier. A draft tree's branch that forks copies its
parent's prefix into a dense `HeadCache` of its own (proposers/eagle3_tree.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [positions, kv_heads, head_dim] each


class HeadKV(Protocol):
    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        """Store K/V [T, kv_heads, head_dim] of positions [start, start + T); returns the K/V of
        positions [0, start + T)."""
        ...

    def prefix(self, end: int) -> KV:  # the K/V of positions [0, end)
        ...


class HeadCache:
    """One request's head K/V in a dense buffer of its own, grown as it goes:
    [capacity, kv_heads, head_dim] each (a tree branch's fork, a calibration's scratch, a test)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.k = torch.empty(0, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        end = start + k.shape[0]
        if end > self.k.shape[0]:
            self._grow(max(end, 2 * self.k.shape[0], 64))
        self.k[start:end], self.v[start:end] = k, v
        return self.prefix(end)

    def prefix(self, end: int) -> KV:
        return self.k[:end], self.v[:end]

    def _grow(self, capacity: int) -> None:
        k = self.k.new_empty(capacity, *self.k.shape[1:])
        v = torch.empty_like(k)
        k[: self.k.shape[0]], v[: self.v.shape[0]] = self.k, self.v
        self.k, self.v = k, v


class HeadKVPool:
    """Every request's head K/V, by the target's KV slot: [num_slots, kv_heads, head_dim] each."""

    def __init__(self, like: HeadCache, num_slots: int, block_size: int) -> None:
        shape = (num_slots, *like.k.shape[1:])
        self.k = like.k.new_zeros(shape)
        self.v = like.k.new_zeros(shape)
        self.block_size = block_size

    @staticmethod
    def bytes_per_slot(like: HeadCache) -> int:
        """What one position costs the pool: its keys and values."""
        per_row = like.k.shape[1] * like.k.shape[2]
        return 2 * per_row * like.k.element_size()

    def cache(self, block_table: list[int]) -> PagedHeadCache:
        """A request's view of the pool, for the step (its blocks do not change within one)."""
        return PagedHeadCache(self, block_table)


class PagedHeadCache:
    """One request's head K/V in the pool, through its block table."""

    def __init__(self, pool: HeadKVPool, block_table: list[int]) -> None:
        self.pool = pool
        size = pool.block_size
        blocks = torch.tensor(block_table, dtype=torch.long, device=pool.k.device)
        offsets = torch.arange(size, device=pool.k.device)
        self.slots = (blocks[:, None] * size + offsets).flatten()  # [positions the table covers]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> KV:
        end = start + k.shape[0]
        slots = self._slots(start, end)
        self.pool.k[slots], self.pool.v[slots] = k, v
        return self.prefix(end)

    def prefix(self, end: int) -> KV:
        slots = self._slots(0, end)
        return self.pool.k[slots], self.pool.v[slots]

    def _slots(self, start: int, end: int) -> torch.Tensor:  # [end - start]
        """The slots of positions [start, end): each one's next."""
        return self.slots[start + 1 : end + 1]


@dataclass(frozen=True)
class HeadSpan:
    """One request's rows in a head forward: positions [start, start + length)."""

    cache: HeadKV
    start: int
    length: int
