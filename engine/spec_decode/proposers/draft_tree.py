"""EAGLE-2's dynamic draft trees from the draft model: tree_search.py's search, the draft's forwards.

Each level is one batched draft forward for all drafting requests. A request's part of it is a
tree of its own, laid out as the runner lays a verify's drafts (`ForwardInput.draft_parents`):
the nodes this level expands and their ancestors, behind the request's last known token (at
position L - 1, L = the tokens the draft has caught up on). Node i of that input is rotated at
its depth's position L - 1 + depth, attends to the context, its ancestors and itself (the tree
mask; on the CPU the native kernel's tree bits), and writes its K/V at slot L + i.

Where the branches' K/V lives: in the draft's own paged pool, in the request's own slots past
its known tokens, [L, L + n): the slots its verify's drafts take in the target's pool, in blocks
no other request shares (only full blocks of known tokens are shared). Every level rewrites them.
The ancestors are run again at each level because a pass sees all of its context: a node may see
its ancestors and not their siblings only when they are in the same pass, under its mask.

Why the draft's frontier stays right after acceptance: a level's nodes are laid out depth-first,
children in the order they were scored (the draft's top pick first), so when the draft's greedy
path is among them it leads, at slots L, L + 1, ..: its K/V is exactly what a chain of the same
tokens would have written there. The Proposal's frontier is L plus the length of that path in the
request's last forward, as far as it agrees with the tree's first path (node d at slot L + d).
After the verify the engine cuts it where the accepted path leaves the tree's first path
(`verify.draft_frontier`) and the scheduler to the accepted prefix, so no node off the first
path, and no rejected one on it, is ever counted as the draft's computed K/V.

A request's slots past L are as many as its block table holds beyond L (at least its k): a level
whose nodes and their ancestors would not fit expands only its best nodes that do (and at most
64 rows: the kernel's tree bits). The catch-up forward drafts the root's children, as for chains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.model.runner import ForwardInput, ModelRunner
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.tree import ROOT, DraftTree, common_prefix
from engine.spec_decode.proposers.tree_search import Row, TreeSearch, grow_trees

# The most rows of one request's tree in a pass: the native kernel's tree bits are one int64 a row.
MAX_TREE_ROWS = 64


def draft_trees(
    runner: ModelRunner,
    items: list[ScheduledSeq],
    budgets: list[int],  # [R] each request's k: its tree's most nodes (and levels)
    logits: torch.Tensor,  # [R, vocab] each request's root row (its catch-up's last)
    width: int,
) -> tuple[list[DraftTree], list[int]]:
    """One tree per request, and how many of its first path's K/V the draft holds in order at
    [L, L + n) (the Proposal's frontier is L + n)."""
    searches = [TreeSearch(item, budget) for item, budget in zip(items, budgets, strict=True)]
    expand = _DraftExpand(runner)
    trees = grow_trees(searches, logits, width, expand)
    held = [
        common_prefix(expand.leading.get(r, []), _leading(tree.parents, tree.token_ids))
        for r, tree in enumerate(trees)
    ]
    return trees, held


class _DraftExpand:
    """One draft forward per level; remembers each request's leading path in its last one."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.leading: dict[int, list[int]] = {}  # request -> tokens at slots L, L + 1, ..

    def __call__(
        self, searches: list[TreeSearch], rows: list[Row]
    ) -> tuple[list[Row], torch.Tensor]:
        inputs: list[ForwardInput] = []
        ran: list[Row] = []
        picks: list[int] = []  # the logits row of each run node
        offset = 0
        for r, search in enumerate(searches):
            wanted = [n for q, n in rows if q == r]
            if not wanted:
                continue
            order, kept = _layout(search, wanted, self._room(search.item))
            inputs.append(self._input(search, order))
            ran += [(r, n) for n in kept]
            picks += [offset + order.index(n) for n in kept]
            self.leading[r] = _leading(inputs[-1].draft_parents or (), inputs[-1].token_ids)
            offset += len(order)
        logits = self.runner.forward(inputs)  # [sum of the inputs' nodes, vocab]
        return ran, logits[torch.tensor(picks, device=logits.device)]

    def _room(self, item: ScheduledSeq) -> int:
        """Slots the request's block table holds past its known tokens."""
        seq = item.seq
        end = len(seq.block_table) * self.runner.block_size
        return min(end - seq.num_computed_tokens - item.num_new_tokens, MAX_TREE_ROWS)

    @staticmethod
    def _input(search: TreeSearch, order: list[int]) -> ForwardInput:
        seq = search.item.seq
        at = {node: i for i, node in enumerate(order)}
        parents = tuple(at.get(search.nodes[n].parent, ROOT) for n in order)
        tokens = [search.nodes[n].token for n in order]
        start = seq.num_computed_tokens + search.item.num_new_tokens
        return ForwardInput(tokens, start, seq.block_table, len(order), len(order), parents)


def _layout(search: TreeSearch, wanted: list[int], room: int) -> tuple[list[int], list[int]]:
    """The level's input for one request: the wanted nodes (best first) that fit in `room` with
    their ancestors, depth-first, children in scoring order; and the wanted nodes kept."""
    members: set[int] = set()
    kept: list[int] = []
    for node in wanted:
        grown = members | set(search.path(node))
        if len(grown) <= room:
            members, kept = grown, [*kept, node]
    children: dict[int, list[int]] = {}
    for node in sorted(members):  # a node's index is above its parent's: parents come first
        children.setdefault(search.nodes[node].parent, []).append(node)
    order: list[int] = []
    stack = list(reversed(children.get(ROOT, [])))
    while stack:
        node = stack.pop()
        order.append(node)
        stack += reversed(children.get(node, []))
    return order, kept


def _leading(parents: Sequence[int], tokens: Sequence[int]) -> list[int]:
    """The tokens of a tree's leading chain: node i while its parent is node i - 1."""
    n = 0
    while n < len(parents) and parents[n] == n - 1:
        n += 1
    return list(tokens[:n])
