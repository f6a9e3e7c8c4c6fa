"""Draft trees: drafts as token ids with parent indices, verified in one forward.

Node i is `token_ids[i]`, a child of node `parents[i]` (ROOT: of the request's last known token,
the one the verify forward computes first). Parents come before their children, so a node's
depth (1 for a child of the root) and its ancestors are known when it is reached. A chain is the
degenerate tree `parents[i] = i - 1`, and every tree built here keeps its most likely path first
(depth-first order, the likeliest child first): node i of that path sits at index i, so when the
verifier keeps it, the K/V the forward wrote for it is already where position order wants it and
nothing moves (as for a chain).

The verify forward (engine/model/runner.py) writes node i's K/V at slot `start + i` (node order),
rotates it at position `start + depth - 1` (the root's is `start - 1`) and lets it attend to the
context and to its ancestors and itself only (`ancestor_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

ROOT = -1  # the parent of depth-1 nodes: the last known token


@dataclass(frozen=True)
class DraftTree:
    token_ids: tuple[int, ...]
    parents: tuple[int, ...]  # [n] each node's parent index, ROOT or an earlier node

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents):
            raise ValueError(f"{len(self.token_ids)} tree tokens for {len(self.parents)} parents")
        if any(not ROOT <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"tree parents must precede their children: {self.parents}")

    @staticmethod
    def chain(token_ids: Sequence[int]) -> DraftTree:
        return DraftTree(tuple(token_ids), tuple(range(-1, len(token_ids) - 1)))

    def __len__(self) -> int:
        return len(self.token_ids)

    @cached_property
    def depths(self) -> tuple[int, ...]:  # [n] 1 for a child of the root
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p == ROOT else depths[p] + 1)
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def _children(self) -> dict[int, list[int]]:
        children: dict[int, list[int]] = {ROOT: []}
        for i, p in enumerate(self.parents):
            children.setdefault(p, []).append(i)
        return children

    def children(self, node: int) -> list[int]:
        """A node's children (ROOT: the depth-1 nodes), likeliest first."""
        return self._children.get(node, [])

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node` (empty for ROOT)."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.token_ids[i] for i in self.path(node)]

    @property
    def leaves(self) -> list[int]:
        return [i for i in range(len(self)) if not self.children(i)]

    def ancestor_mask(self) -> torch.Tensor:  # [n, n] bool: node i sees node j (j on i's path)
        mask = torch.zeros(len(self), len(self), dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p != ROOT:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def kv_moves(self, accepted: Sequence[int]) -> list[tuple[int, int]]:
        """(from, to) node slots that put the accepted path's K/V in position order: node
        accepted[d] was written at slot index accepted[d] and belongs at d. Empty where the path
        is already in place (a chain, or the tree's first path)."""
        return [(node, d) for d, node in enumerate(accepted) if node != d]


def tree_from_paths(paths: Sequence[Sequence[int]], budget: int, branch_len: int) -> DraftTree:
    """A tree of at most `budget` nodes merging candidate continuations, the likeliest first.

    The first path is the chain a proposer would draft alone; each further path adds at most
    `branch_len` nodes past where it leaves the tree. Branches take at most half the budget, the
    first path keeps the rest, so a tree never drafts less deep than half a chain."""
    if not paths or budget <= 0:
        return DraftTree((), ())
    first = list(paths[0])
    extra = [min(branch_len, len(p) - common_prefix(p, first)) for p in paths[1:]]
    reserve = min(sum(e for e in extra if e > 0), budget // 2)
    trie = _Trie()
    trie.insert(first[: budget - reserve], budget)
    for path, n in zip(paths[1:], extra, strict=True):
        if n > 0:
            trie.insert(list(path[: common_prefix(path, first) + n]), budget)
    return trie.flatten()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _Trie:
    """Nodes in insertion order (children likeliest first), flattened depth-first."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.kids: dict[int, dict[int, int]] = {ROOT: {}}  # node -> token -> child

    def insert(self, path: list[int], budget: int) -> None:
        node = ROOT
        for token in path:
            child = self.kids[node].get(token)
            if child is None:
                if len(self.tokens) >= budget:
                    return
                child = len(self.tokens)
                self.tokens.append(token)
                self.kids[node][token] = child
                self.kids[child] = {}
            node = child

    def flatten(self) -> DraftTree:
        tokens: list[int] = []
        parents: list[int] = []
        stack = [(child, ROOT) for child in reversed(self.kids[ROOT].values())]
        while stack:
            node, parent = stack.pop()
            index = len(tokens)
            tokens.append(self.tokens[node])
            parents.append(parent)
            stack += [(child, index) for child in reversed(self.kids[node].values())]
        return DraftTree(tuple(tokens), tuple(parents))
