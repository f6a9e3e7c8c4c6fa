"""EAGLE-2's dynamic tree search (Li et al. 2024, "EAGLE-2"), whatever runs the draft.

Each level expands the `width` likeliest open nodes by their cumulative draft probability (the
product of q along the path): one draft forward per level for all drafting requests (`Expand`,
the proposer's own), every expanded node's top-`width` children scored, the next level's nodes
the `width` best of those. After the last level the tree keeps the `budget` best nodes of all
scored ones; a child never scores above its parent (ties go to the shallower node), so the kept
set holds every kept node's ancestors. Its depth-first order, children best first, puts the
greedy path first.

The nodes are the draft's top picks, not samples from it: each verifies as a deterministic draft
(q one-hot), which keeps rejection sampling exact (engine/spec_decode/tree_sampler.py). A
request's grammar masks each node's row after the node's own path; logit bias and penalties are
left to the target's verify rows (they change which nodes are likely, never what is emitted).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.sample import structured
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.tree import ROOT, DraftTree

Row = tuple[int, int]  # (request, node): a node to run the draft at, ROOT for the request's root


@dataclass
class Node:
    token: int
    parent: int  # index in the request's node list, ROOT for depth 1
    depth: int
    score: float  # log of the product of q along the path


@dataclass
class TreeSearch:
    """One request's search: every node scored so far, and the ones the next level expands."""

    item: ScheduledSeq
    budget: int  # the request's k: its tree's most nodes (and levels)
    nodes: list[Node] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # nodes to expand at the next level

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node` (empty for ROOT)."""
        nodes = []
        while node != ROOT:
            nodes.append(node)
            node = self.nodes[node].parent
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.nodes[n].token for n in self.path(node)]

    def tree(self) -> DraftTree:
        """The budget's best nodes, depth-first with each node's children best first."""
        nodes = self.nodes
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth))
        children: dict[int, list[int]] = {ROOT: []}
        for i in sorted(order[: self.budget], key=lambda i: -nodes[i].score):
            children.setdefault(nodes[i].parent, []).append(i)
        tokens: list[int] = []
        parents: list[int] = []
        stack = [(c, ROOT) for c in reversed(children[ROOT])]
        while stack:
            node, parent = stack.pop()
            tokens.append(nodes[node].token)
            parents.append(parent)
            stack += [(c, len(tokens) - 1) for c in reversed(children.get(node, []))]
        return DraftTree(tuple(tokens), tuple(parents))


# One level's draft forward: the rows it ran (those asked, or fewer) and their logits [rows, vocab]
Expand = Callable[[list[TreeSearch], list[Row]], tuple[list[Row], torch.Tensor]]


def grow_trees(
    searches: list[TreeSearch],
    logits: torch.Tensor,  # [R, vocab] each request's root row (its catch-up's last)
    width: int,
    expand: Expand,
) -> list[DraftTree]:
    """One tree per request: the root's children scored, then one `expand` per level."""
    score_children(searches, [(r, ROOT) for r in range(len(searches))], logits, width)
    for _ in range(1, max((s.budget for s in searches), default=0)):
        rows = [(r, n) for r, search in enumerate(searches) for n in search.frontier]
        if not rows:
            break
        rows, logits = expand(searches, rows)
        score_children(searches, rows, logits, width)
    return [search.tree() for search in searches]


def score_children(
    searches: list[TreeSearch],
    rows: list[Row],  # (request, node) whose children the logits score
    logits: torch.Tensor,  # [len(rows), vocab]
    width: int,
) -> None:
    """Each row's `width` likeliest tokens become its children; each request's next frontier is
    the `width` best children of this level."""
    logits = structured.constrain_draft_logits(
        [searches[r].item.seq.constraint for r, _ in rows],
        logits,
        [searches[r].path_tokens(n) for r, n in rows],
    )
    top_q, top_ids = torch.softmax(logits.float(), -1).topk(width, dim=-1)  # [rows, width] each
    for search in searches:
        search.frontier = []
    for (r, n), qs, ids in zip(rows, top_q.tolist(), top_ids.tolist(), strict=True):
        search = searches[r]
        parent = None if n == ROOT else search.nodes[n]
        score, depth = (0.0, 1) if parent is None else (parent.score, parent.depth + 1)
        for q, token in zip(qs, ids, strict=True):
            if q > 0.0 and depth <= search.budget:
                search.nodes.append(Node(token, n, depth, score + math.log(q)))
                search.frontier.append(len(search.nodes) - 1)
    for search in searches:
        nodes = search.nodes
        search.frontier = sorted(search.frontier, key=lambda i: -nodes[i].score)[:width]
