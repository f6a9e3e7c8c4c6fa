"""EAGLE-2's dynamic draft trees from an EAGLE-3 head (Li et al. 2024, "EAGLE-2").

The search itself (which nodes a level expands, which the tree keeps) is tree_search.py's; this
module runs the head for each level: one head forward for all drafting requests' expanded nodes,
each fed its parent's output and its own token.

The head's K/V is one cache per request by position (engine/model/head_kv.py), which has no tree
mask: a branch that forks gets its own dense copy of its parent's cache (the prefix and its path
so far, some tens of KB), so each row attends to exactly the context and its own path; the first
branch of a level goes on writing the request's own slots.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.model.head_kv import HeadCache, HeadKV, HeadSpan
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.tree import ROOT, DraftTree
from engine.spec_decode.proposers.tree_search import Row, TreeSearch, grow_trees

# One head forward: (hidden [T, hidden], token ids, spans) -> logits [T, vocab], prenorm [T, hidden]
HeadRun = Callable[[torch.Tensor, list[int], list[HeadSpan]], tuple[torch.Tensor, torch.Tensor]]


def draft_trees(
    run: HeadRun,
    new_cache: Callable[[], HeadCache],
    items: list[ScheduledSeq],
    budgets: list[int],  # [R] each request's k: its tree's most nodes (and levels)
    caches: list[HeadKV],
    logits: torch.Tensor,  # [R, vocab] each request's root row (its catch-up's last)
    hidden: torch.Tensor,  # [R, hidden] the root rows' prenorm
    width: int,
) -> list[DraftTree]:
    """One tree per request."""
    searches = [TreeSearch(item, budget) for item, budget in zip(items, budgets, strict=True)]
    expand = _HeadExpand(run, new_cache, caches, hidden)
    return grow_trees(searches, logits, width, expand)


class _HeadExpand:
    """The head at each expanded node's position, over the node's branch cache; keeps each
    run node's output (the next level's input) and cache."""

    def __init__(
        self,
        run: HeadRun,
        new_cache: Callable[[], HeadCache],
        caches: list[HeadKV],  # each request's own head cache: its prefix, caught up
        hidden: torch.Tensor,  # [R, hidden] the root rows' prenorm
    ) -> None:
        self.run = run
        self.new_cache = new_cache
        self.caches: dict[Row, HeadKV] = {(r, ROOT): c for r, c in enumerate(caches)}
        self.hidden: dict[Row, torch.Tensor] = {(r, ROOT): hidden[r] for r in range(len(caches))}

    def __call__(
        self, searches: list[TreeSearch], rows: list[Row]
    ) -> tuple[list[Row], torch.Tensor]:
        hidden, spans, tokens = [], [], []
        used: set[int] = set()  # caches a row of this level writes already
        for r, n in rows:
            node = searches[r].nodes[n]
            hidden.append(self.hidden[(r, node.parent)])
            base = self.caches[(r, node.parent)]
            position = searches[r].item.seq.num_computed_tokens - 1 + node.depth
            cache = base if id(base) not in used else _fork(self.new_cache(), base, position)
            self.caches[(r, n)] = cache
            used.add(id(cache))
            spans.append(HeadSpan(cache, position, 1))
            tokens.append(node.token)
        logits, out = self.run(torch.stack(hidden), tokens, spans)  # [rows, vocab], [rows, hidden]
        self.hidden = {row: out[i] for i, row in enumerate(rows)}
        return rows, logits


def _fork(fork: HeadCache, cache: HeadKV, end: int) -> HeadCache:
    """`fork` (an empty cache) filled with the cache's positions [0, end): a sibling's own."""
    fork.write(0, *cache.prefix(end))
    return fork
