"""The speculative step's verify and accept stages, between the proposers and the scheduler.

`verify_inputs` lays each request's new tokens and drafts (a chain, or a tree with its parents)
into the target's one ragged forward; `verify_step` turns the forward's logits into each
request's emitted tokens: chains in one batched pass (`verify_batch`), trees one request at a
time (`verify_tree`), and for a tree the K/V moves that put its accepted path in position order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.runner import ForwardInput
from engine.outputs import TokenLogprob
from engine.sample import structured
from engine.sample.sampler import emitted_logprobs
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.base import Proposal
from engine.spec_decode.rejection_sampler import verify_batch
from engine.spec_decode.tree_sampler import verify_tree


@dataclass(frozen=True)
class Verified:
    """One request's outcome of the step's verification."""

    tokens: list[int] = field(default_factory=list)  # accepted + recovered/bonus; [] for a chunk
    logprobs: list[TokenLogprob] | None = None  # one per token where asked
    # (from, to) positions whose K/V must move: a tree's accepted path out of node order
    kv_moves: list[tuple[int, int]] = field(default_factory=list)


def num_logits(item: ScheduledSeq, proposal: Proposal) -> int:
    """Rows of target logits a request needs: every prompt position when it wants prompt logprobs,
    else the last one where its chunk reaches the end; plus one per draft."""
    base = item.num_new_tokens if item.seq.wants_prompt_logprobs else int(item.reaches_end)
    return base + len(proposal.token_ids)


def verify_inputs(batch: list[ScheduledSeq], proposals: list[Proposal]) -> list[ForwardInput]:
    """The target sees each request's new tokens plus its drafts, all in one ragged forward."""
    inputs = []
    for item, proposal in zip(batch, proposals, strict=True):
        seq, start = item.seq, item.seq.num_computed_tokens
        known = seq.token_ids[start : start + item.num_new_tokens]
        drafts = proposal.token_ids
        inputs.append(
            ForwardInput(
                known + drafts,
                start,
                seq.block_table,
                num_logits(item, proposal),
                len(drafts),
                proposal.parents,
                seq.state_slot,
            )
        )
    return inputs


def verify_step(
    batch: list[ScheduledSeq],
    proposals: list[Proposal],
    logits: torch.Tensor,  # [sum(num_logits), vocab_size]
) -> list[Verified]:
    """Every request whose chunk reaches the end verifies its drafts: what it emits (nothing for
    a prompt chunk), its logprobs where asked, and for a tree the K/V moves of its path."""
    # p = the target's processed probs at each draft position plus the bonus one; q = the draft's.
    # Accept x_i with prob min(1, p(x_i) / q(x_i)); at the first rejection the recovered token is
    # drawn from norm(max(0, p - q)); if all k pass, the bonus token is drawn from p. Greedy:
    # accept while x_i == argmax p. Either way the emitted tokens follow p exactly. A tree tries
    # a node's children in turn against what the earlier ones left (tree_sampler.py).
    rows = _verify_rows(batch, proposals)  # each request's k_b + 1 verify rows, where at the end
    verified = [Verified() for _ in batch]
    chains = [i for i, r in enumerate(rows) if r is not None and proposals[i].parents is None]
    if chains:
        chain_logits = _take_rows(logits, [rows[i] for i in chains])  # [num_tokens, vocab_size]
        tokens, logprobs = _verify_chains(batch, proposals, chain_logits, chains)
        for i, run, lps in zip(chains, tokens, logprobs, strict=True):
            verified[i] = Verified(run, lps)
    for i, (item, span) in enumerate(zip(batch, rows, strict=True)):
        if span is not None and proposals[i].parents is not None:
            verified[i] = _verify_tree(item, proposals[i], logits[span])
    return verified


def draft_frontier(proposal: Proposal, outcome: Verified) -> int | None:
    """The draft model's K/V frontier after the verify. Of a tree's nodes the draft holds the K/V
    of its first path only, in place (proposers/draft_tree.py): where the accepted path leaves
    that path (its first K/V move's destination), the draft's K/V there is another node's. The
    scheduler then clamps the frontier to the accepted prefix, as for a chain."""
    frontier = proposal.num_draft_computed
    if frontier is None or not outcome.kv_moves:
        return frontier
    return min(frontier, outcome.kv_moves[0][1])


def _verify_chains(
    batch: list[ScheduledSeq],
    proposals: list[Proposal],
    target_logits: torch.Tensor,  # [num_tokens, vocab_size]: k_b + 1 rows per request of `ends`
    ends: list[int],
) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """The chains in one batched pass: tokens and logprobs, in `ends` order."""
    vocab_size = target_logits.shape[1]
    seqs = [batch[i].seq for i in ends]
    drafts = [proposals[i].token_ids for i in ends]
    constrained = structured.constrain_verify_rows(
        [s.constraint for s in seqs], target_logits, drafts
    )
    tokens = verify_batch(
        constrained,
        drafts,
        [match_vocab(proposals[i].probs, vocab_size) for i in ends],
        [seq.params for seq in seqs],
        [seq.output_token_ids if seq.params.has_penalties else [] for seq in seqs],
        [seq.seeded_row_keys(len(d) + 1) for seq, d in zip(seqs, drafts, strict=True)],
    )
    logprobs = emitted_logprobs(
        [seq.params.logprobs for seq in seqs], target_logits, drafts, tokens
    )
    return tokens, logprobs


def _verify_tree(
    item: ScheduledSeq,
    proposal: Proposal,
    rows: torch.Tensor,  # [n + 1, vocab_size]: the root's row, then one per node
) -> Verified:
    tree = proposal.tree
    assert tree is not None
    seq = item.seq
    result = verify_tree(
        rows,
        tree,
        match_vocab(proposal.probs, rows.shape[1]),
        seq.params,
        seq.output_token_ids if seq.params.has_penalties else [],
        seq.constraint,
        seq.seeded_row_keys(tree.max_depth + 1),
    )
    path_rows = rows[[0] + [1 + node for node in result.nodes]]  # [len(tokens), vocab_size]
    accepted = result.tokens[:-1]
    (logprobs,) = emitted_logprobs([seq.params.logprobs], path_rows, [accepted], [result.tokens])
    first = seq.num_computed_tokens + item.num_new_tokens  # the position of node 0's slot
    moves = [(first + src, first + dst) for src, dst in tree.kv_moves(result.nodes)]
    return Verified(result.tokens, logprobs, moves)


def _verify_rows(batch: list[ScheduledSeq], proposals: list[Proposal]) -> list[slice | None]:
    """Each request's last k_b + 1 logits rows; None where its chunk does not reach the end."""
    rows: list[slice | None] = []
    offset = 0
    for item, proposal in zip(batch, proposals, strict=True):
        offset += num_logits(item, proposal)
        k = len(proposal.token_ids)
        rows.append(slice(offset - k - 1, offset) if item.reaches_end else None)
    return rows


def _take_rows(
    logits: torch.Tensor,  # [sum(num_logits), vocab_size]
    spans: list[slice | None],
) -> torch.Tensor:  # [sum of the spans' rows, vocab_size]
    index = [r for span in spans if span is not None for r in range(span.start, span.stop)]
    if index == list(range(index[0], index[0] + len(index))):
        return logits[index[0] : index[0] + len(index)]  # the usual case: no copy
    return logits[index]


def match_vocab(probs: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """Draft and target may pad their embeddings differently; the tokenizer is the same."""
    if probs is None or probs.shape[-1] == vocab_size:
        return probs
    if probs.shape[-1] > vocab_size:
        return probs[:, :vocab_size]
    return torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[-1]))
