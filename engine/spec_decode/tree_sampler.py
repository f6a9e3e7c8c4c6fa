"""Stateless verification of a draft tree (engine/spec_decode/proposers/tree.py): the longest path the
target keeps, then one recovered or bonus token.

Row 0 of a request's verify rows is the target at its last known token (the root), row 1 + i at
node i. Each row is processed as `verify_batch` processes a chain's: grammar masks and penalties
after the tokens on the node's own path, then temperature, top-k, top-p, min-p.

Greedy and seeded requests match: the target's own token at a row (the argmax, or the Gumbel-max
under the noise of the output position the row fills, a function of its depth only) is followed
down to the child that drafted it; where no child did, it is the recovered token, and past a
leaf the bonus. The emitted text is exactly plain decoding's, whatever the tree.

Unseeded sampled requests use multi-step (recursive) rejection sampling over the siblings
(SpecInfer, Miao et al. 2024; EAGLE-2's verifier), with p the target's row and q_c the
distribution child c was drawn from (one-hot for a deterministic draft: an n-gram match, a top-k
pick):

    for each child c of the current node, in order:
        accept c with probability min(1, p(x_c) / q_c(x_c)); if accepted, descend to c
        else p <- norm(max(0, p - q_c))
    no child accepted: draw the recovered token from p (the residual); at a leaf: bonus from p

Each round is one speculative-sampling step of the chain case against the residual left by the
rounds before it, so the token emitted at each node is distributed exactly as p (SpecInfer,
Theorem 4.2); siblings must be distinct tokens or independent draws from q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sample import structured
from engine.sample.sampler import exponential, processed_probs
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import gumbel_max, race
from engine.sample.structured import ConstraintState
from engine.spec_decode.proposers.tree import ROOT, DraftTree


@dataclass(frozen=True)
class TreeResult:
    tokens: list[int]  # the accepted path's tokens, then the recovered or bonus token
    nodes: list[int]  # the accepted path's node indices (len(tokens) - 1 of them)


def verify_tree(
    target_logits: Tensor,  # [n + 1, V] raw target logits: the root's row, then one per node
    tree: DraftTree,
    draft_probs: Tensor | None,  # [n, V] the q each node was drawn from; None: one-hot drafts
    params: SamplingParams,
    output_token_ids: list[int],  # tokens so far; read only where penalties apply
    constraint: ConstraintState | None,
    row_keys: list[int] | None,  # [max_depth + 1] a seeded request's keys, by depth
    generator: torch.Generator | None = None,
) -> TreeResult:
    if target_logits.shape[0] != len(tree) + 1:
        raise ValueError(f"{target_logits.shape[0]} verify rows for a tree of {len(tree)} nodes")
    logits = constrain_tree_rows(constraint, target_logits, tree)
    histories = [
        output_token_ids + tree.path_tokens(r - 1) if params.has_penalties else []
        for r in range(len(tree) + 1)
    ]
    probs = processed_probs(logits, [params] * (len(tree) + 1), histories)  # [n + 1, V]
    if params.greedy or row_keys is not None:
        return _match(tree, _own_tokens(probs, tree, row_keys))
    return _reject(tree, probs, draft_probs, generator)


def constrain_tree_rows(
    state: ConstraintState | None,
    logits: Tensor,  # [n + 1, V] raw: the root's row, then one per node
    tree: DraftTree,
) -> Tensor:  # [n + 1, V]; `logits` itself without a constraint
    """Each row biased and masked after the tokens on its own path, as `constrain_rows` does
    for a chain's: one pass of the matcher down each root-to-leaf path."""
    if state is None:
        return logits
    out = logits.float().clone()
    for leaf in tree.leaves or [ROOT]:
        rows = [0] + [1 + i for i in tree.path(leaf)]
        out[rows] = structured.constrain_rows(state, logits[rows], tree.path_tokens(leaf))
    return out


def _own_tokens(
    probs: Tensor,  # [n + 1, V] processed; one-hot rows for greedy
    tree: DraftTree,
    row_keys: list[int] | None,  # by depth: the root's row fills output position 0
) -> list[int]:  # [n + 1] the target's own token at each row
    if row_keys is None:
        return probs.argmax(dim=-1).tolist()
    keys = [row_keys[0]] + [row_keys[d] for d in tree.depths]
    return gumbel_max(probs, keys).tolist()


def _match(tree: DraftTree, own: list[int]) -> TreeResult:
    node, nodes = ROOT, list[int]()
    while True:
        token = own[node + 1]
        child = next((c for c in tree.children(node) if tree.token_ids[c] == token), None)
        if child is None:
            return TreeResult([tree.token_ids[c] for c in nodes] + [token], nodes)
        node = child
        nodes.append(child)


def _reject(
    tree: DraftTree,
    probs: Tensor,  # [n + 1, V] processed target probs
    draft_probs: Tensor | None,  # [n, V]; None: one-hot drafts
    generator: torch.Generator | None,
) -> TreeResult:
    node, nodes = ROOT, list[int]()
    u = torch.rand(len(tree), generator=generator).tolist()  # one uniform per node, at most
    while True:
        p = probs[node + 1]  # [V]
        accepted = None
        for child in tree.children(node):
            x = tree.token_ids[child]
            q = _q(draft_probs, child, x, p)  # [V]
            # u < p/q without dividing: q == 0 < p accepts, p == 0 always rejects.
            if u[child] * float(q[x]) < float(p[x]):
                accepted = child
                break
            residual = (p - q).clamp_min(0.0)
            # p == q leaves nothing to recover from (only reached by float error): keep p.
            if float(residual.sum()) > 0.0:
                p = residual / residual.sum()
        if accepted is None:
            noise = exponential((1, p.shape[0]), generator, p.device)  # [1, V]
            final = int(race(p[None], noise)[0])
            return TreeResult([tree.token_ids[c] for c in nodes] + [final], nodes)
        node = accepted
        nodes.append(accepted)


def _q(draft_probs: Tensor | None, child: int, token: int, like: Tensor) -> Tensor:  # [V]
    if draft_probs is not None:
        return draft_probs[child].to(like)
    return torch.zeros_like(like).index_fill_(0, torch.tensor([token], device=like.device), 1.0)
