"""EAGLE-2's dynamic draft trees from an EAGLE-3 head (Li et al. 2024, "EAGLE-2").

Each level expands the `width` likeliest open nodes by their cumulative draft probability (the
product of q along the path): one head forward per level for all drafting requests, every
expanded node's top-`width` children scored, the next level's nodes the `width` best of those.
After the last level the tree keeps the `budget` best nodes of all scored ones; a child never
scores above its parent (ties go to the shallower node), so the kept set holds every kept
node's ancestors. Its depth-first order, children best first, puts the greedy path first.

The head's K/V is one cache per request by position (engine/model/eagle3.py `HeadCache`), which
has no tree mask: a branch that forks gets its own copy of its parent's cache (the prefix and its
path so far, some tens of KB), so each row attends to exactly the context and its own path.

The nodes are the draft's top picks, not samples from it: each verifies as a deterministic draft
(q one-hot), which keeps rejection sampling exact (engine/spec_decode/tree_sampler.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.model.eagle3 import HeadCache, HeadSpan
from engine.sample import structured
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.tree import ROOT, DraftTree

# One head forward: (hidden [T, hidden], token ids, spans) -> logits [T, vocab], prenorm [T, hidden]
HeadRun = Callable[[torch.Tensor, list[int], list[HeadSpan]], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Node:
    token: int
    parent: int  # index in the request's node list, ROOT for depth 1
    depth: int
    score: float  # log of the product of q along the path
    cache: HeadCache | None = None  # the branch's head cache once the node is expanded


@dataclass
class _Request:
    item: ScheduledSeq
    cache: HeadCache  # the request's own head cache: its prefix, caught up
    budget: int
    nodes: list[_Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # nodes to expand at the next level

    def path_tokens(self, node: int) -> list[int]:
        tokens = []
        while node != ROOT:
            tokens.append(self.nodes[node].token)
            node = self.nodes[node].parent
        return tokens[::-1]


def draft_trees(
    run: HeadRun,
    new_cache: Callable[[], HeadCache],
    items: list[ScheduledSeq],
    budgets: list[int],  # [R] each request's k: its tree's most nodes (and levels)
    caches: list[HeadCache],
    logits: torch.Tensor,  # [R, vocab] each request's root row (its catch-up's last)
    hidden: torch.Tensor,  # [R, hidden] the root rows' prenorm
    width: int,
) -> list[DraftTree]:
    """One tree per request."""
    requests = [
        _Request(item, cache, budget)
        for item, cache, budget in zip(items, caches, budgets, strict=True)
    ]
    parents_hidden = {(r, ROOT): hidden[r] for r in range(len(requests))}
    _score_children(requests, [(r, ROOT) for r in range(len(requests))], logits, width)
    for _ in range(1, max((r.budget for r in requests), default=0)):
        rows = [(r, n) for r, req in enumerate(requests) for n in req.frontier]
        if not rows:
            break
        logits, out = _expand(run, new_cache, requests, rows, parents_hidden)
        parents_hidden = {row: out[i] for i, row in enumerate(rows)}
        _score_children(requests, rows, logits, width)
    return [_tree_of(req) for req in requests]


def _expand(
    run: HeadRun,
    new_cache: Callable[[], HeadCache],
    requests: list[_Request],
    rows: list[tuple[int, int]],  # (request, node) to run the head at
    parents_hidden: dict[tuple[int, int], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:  # logits [len(rows), vocab], prenorm [len(rows), hidden]
    """The head at each node's position: its parent's output and its own token, over the
    node's branch cache."""
    hidden, spans, tokens = [], [], []
    used: set[int] = set()  # caches a row of this level writes already
    for r, n in rows:
        req, node = requests[r], requests[r].nodes[n]
        parent = req.nodes[node.parent] if node.parent != ROOT else None
        hidden.append(parents_hidden[(r, node.parent)])
        base = req.cache if parent is None else parent.cache
        assert base is not None
        position = req.item.seq.num_computed_tokens - 1 + node.depth
        node.cache = base if id(base) not in used else _fork(new_cache(), base, position)
        used.add(id(node.cache))
        spans.append(HeadSpan(node.cache, position, 1))
        tokens.append(node.token)
    return run(torch.stack(hidden), tokens, spans)


def _fork(fork: HeadCache, cache: HeadCache, end: int) -> HeadCache:
    """`fork` (an empty cache) filled with the cache's positions [0, end): a sibling's own."""
    fork.write(0, cache.k[:end], cache.v[:end])
    return fork


def _score_children(
    requests: list[_Request],
    rows: list[tuple[int, int]],  # (request, node) whose children the logits score
    logits: torch.Tensor,  # [len(rows), vocab]
    width: int,
) -> None:
    """Each row's `width` likeliest tokens become its children; each request's next frontier is
    the `width` best children of this level."""
    logits = structured.constrain_draft_logits(
        [requests[r].item.seq.constraint for r, _ in rows],
        logits,
        [requests[r].path_tokens(n) for r, n in rows],
    )
    top_q, top_ids = torch.softmax(logits.float(), -1).topk(width, dim=-1)  # [rows, width] each
    for req in requests:
        req.frontier = []
    for (r, n), qs, ids in zip(rows, top_q.tolist(), top_ids.tolist(), strict=True):
        req = requests[r]
        parent_score, depth = (
            (0.0, 1) if n == ROOT else (req.nodes[n].score, req.nodes[n].depth + 1)
        )
        for q, token in zip(qs, ids, strict=True):
            if q > 0.0 and depth <= req.budget:
                req.nodes.append(_Node(token, n, depth, parent_score + math.log(q)))
                req.frontier.append(len(req.nodes) - 1)
    for req in requests:
        req.frontier = sorted(req.frontier, key=lambda i: -req.nodes[i].score)[:width]


def _tree_of(req: _Request) -> DraftTree:
    """The budget's best nodes, depth-first with each node's children best first."""
    order = sorted(range(len(req.nodes)), key=lambda i: (-req.nodes[i].score, req.nodes[i].depth))
    kept = set(order[: req.budget])
    children: dict[int, list[int]] = {ROOT: []}
    for i in sorted(kept, key=lambda i: -req.nodes[i].score):
        children.setdefault(req.nodes[i].parent, []).append(i)
    tokens: list[int] = []
    parents: list[int] = []
    stack = [(c, ROOT) for c in reversed(children[ROOT])]
    while stack:
        node, parent = stack.pop()
        tokens.append(req.nodes[node].token)
        parents.append(parent)
        index = len(tokens) - 1
        stack += [(c, index) for c in reversed(children.get(node, []))]
    return DraftTree(tuple(tokens), tuple(parents))
