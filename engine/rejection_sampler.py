"""Stateless verification of draft tokens against the target's processed distribution.

vLLM's vocabulary: drafts the target keeps are *accepted*; at the first rejection the target
emits a *recovered* token in their place; when all k drafts are accepted it emits a *bonus*
token from its distribution after the last draft. Either way each verify emits a+1 tokens.

The math (Leviathan et al. 2023; Chen et al. 2023), with p the target and q the draft:
    accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i))
    on the first rejection, recover from norm(max(0, p_i - q_i))
    all accepted: bonus from p_k
Then every emitted token is distributed exactly as p: P(x) = q(x) min(1, p(x)/q(x)) +
(1 - sum_y min(q(y), p(y))) * norm(max(0, p - q))(x) = min(q(x), p(x)) + max(0, p(x) - q(x)).
A one-hot draft (n-gram) has q_i(x_i) = 1: accept with probability p_i(x_i), else recover from
p_i with x_i removed. Greedy is the limit where p is one-hot: accept while the draft equals the
target's argmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.sampler import exponential, race


def verify(
    target_probs: Tensor,  # [k+1, V] processed target probs at each draft position + bonus
    draft_token_ids: list[int],  # k proposed tokens
    draft_probs: Tensor | None,  # [k, V] draft's processed probs; None = one-hot (n-gram)
    greedy: bool,
    generator: torch.Generator | None,
) -> list[int]:
    """The accepted drafts followed by one recovered or bonus token: a+1 ids, a in 0..k."""
    if greedy:
        return verify_greedy(target_probs, draft_token_ids)
    drafts = torch.tensor([draft_token_ids], dtype=torch.long, device=target_probs.device)
    q = None if draft_probs is None else draft_probs[None]
    num_accepted, final = verify_stochastic(target_probs[None], drafts, q, generator)
    a = int(num_accepted.item())
    return draft_token_ids[:a] + [int(final.item())]


def verify_greedy(
    target_probs: Tensor,  # [k+1, V] (or logits: only the argmax matters)
    draft_token_ids: list[int],
) -> list[int]:
    target_ids: list[int] = target_probs.argmax(dim=-1).tolist()  # [k+1]
    a = 0
    while a < len(draft_token_ids) and draft_token_ids[a] == target_ids[a]:
        a += 1
    return draft_token_ids[:a] + [target_ids[a]]


def verify_stochastic(
    target_probs: Tensor,  # [B, k+1, V]
    draft_token_ids: Tensor,  # [B, k] long
    draft_probs: Tensor | None,  # [B, k, V]; None = one-hot drafts
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:  # num_accepted [B], final (recovered or bonus) token [B]
    """Batched rejection sampling; B rows share one generator (draws: B*k uniforms, B*V exps)."""
    batch, k = draft_token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    accepted = _accept_mask(target_probs, draft_token_ids, draft_probs, generator)  # [B, k]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    final_dist = target_probs[rows, num_accepted]  # [B, V], the bonus distribution if a == k
    if k > 0:
        final_dist = _recovery_dist(final_dist, draft_token_ids, draft_probs, num_accepted)
    noise = exponential(tuple(final_dist.shape), generator, final_dist.device)  # [B, V]
    return num_accepted, race(final_dist, noise)


def _accept_mask(
    target_probs: Tensor,  # [B, k+1, V]
    draft_token_ids: Tensor,  # [B, k]
    draft_probs: Tensor | None,  # [B, k, V]
    generator: torch.Generator | None,
) -> Tensor:  # [B, k] bool
    index = draft_token_ids[..., None]  # [B, k, 1]
    p = target_probs[:, :-1].gather(-1, index).squeeze(-1)  # [B, k]
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, index).squeeze(-1)
    u = torch.rand(p.shape, generator=generator, device=p.device)  # [B, k] in [0, 1)
    # u < p/q without dividing: q == 0 < p accepts, p == 0 always rejects.
    return u * q < p


def _recovery_dist(
    final_dist: Tensor,  # [B, V] target probs at position num_accepted
    draft_token_ids: Tensor,  # [B, k]
    draft_probs: Tensor | None,  # [B, k, V]
    num_accepted: Tensor,  # [B]
) -> Tensor:  # [B, V] unnormalized: max(0, p - q) where rejected, p where all were accepted
    batch, k = draft_token_ids.shape
    rows = torch.arange(batch, device=final_dist.device)
    pos = num_accepted.clamp(max=k - 1)  # [B]
    if draft_probs is None:
        q = torch.zeros_like(final_dist).scatter_(1, draft_token_ids[rows, pos][:, None], 1.0)
    else:
        q = draft_probs[rows, pos]  # [B, V]
    residual = (final_dist - q).clamp_min(0.0)  # [B, V]
    # p == q leaves nothing to recover from (only reached by float error): fall back to p.
    use_target = (num_accepted == k) | (residual.sum(dim=-1) <= 0.0)  # [B]
    return torch.where(use_target[:, None], final_dist, residual)
