"""Stateless sampling: penalties, temperature, top-k/top-p/min-p, sampling and logprobs.

Every function works on a batch of rows, one row per (request, position). Rows are
independent: a row's result never depends on the other rows in the batch, which is what
makes seeded sampling reproducible whatever the batch composition.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


def processed_probs(
    logits: Tensor,  # [N, V] float32 raw logits
    params: list[SamplingParams],  # one per row
    output_token_ids: list[list[int]],  # tokens generated so far per row (may include drafts)
) -> Tensor:  # [N, V] float32 probabilities; greedy rows are one-hot on the argmax
    logits = logits.float()
    if any(p.has_penalties for p in params):
        logits = apply_penalties(logits, params, output_token_ids)
    if all(p.greedy for p in params):
        return _one_hot_argmax(logits)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)  # [N]
    greedy_probs = _one_hot_argmax(logits) if greedy.any() else None
    temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    logits = logits / temps[:, None]
    if any(_has_top_k(p, logits.shape[1]) or p.top_p < 1.0 for p in params):
        logits = apply_top_k_top_p(logits, params)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    if any(p.min_p > 0.0 for p in params):
        probs = apply_min_p(probs, params)
    if greedy_probs is not None:
        probs = torch.where(greedy[:, None], greedy_probs, probs)
    return probs


def apply_penalties(
    logits: Tensor,  # [N, V]
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
) -> Tensor:  # [N, V]
    """OpenAI semantics: logit[t] -= presence * (count[t] > 0) + frequency * count[t]."""
    counts = token_counts(output_token_ids, params, logits.shape[1], logits.device)  # [N, V]
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)
    return logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts


def token_counts(
    output_token_ids: list[list[int]],
    params: list[SamplingParams],
    vocab_size: int,
    device: torch.device,
) -> Tensor:  # [N, V] float32 occurrence counts, zero for rows without penalties
    rows: list[int] = []
    ids: list[int] = []
    for i, (p, toks) in enumerate(zip(params, output_token_ids, strict=True)):
        if p.has_penalties:
            rows += [i] * len(toks)
            ids += toks
    counts = torch.zeros(len(params), vocab_size, device=device)
    if ids:
        index = (torch.tensor(rows, device=device), torch.tensor(ids, device=device))
        counts.index_put_(index, torch.ones(len(ids), device=device), accumulate=True)
    return counts


def verification_histories(
    output_token_ids: list[int], draft_token_ids: list[int]
) -> list[list[int]]:
    """Penalty histories for verifying k drafts: row i counts the drafts before position i."""
    return [output_token_ids + draft_token_ids[:i] for i in range(len(draft_token_ids) + 1)]


def apply_top_k_top_p(logits: Tensor, params: list[SamplingParams]) -> Tensor:  # [N, V]
    """Mask everything outside each row's top-k, then outside its top-p nucleus (one sort)."""
    vocab_size = logits.shape[1]
    top_k = torch.tensor(
        [p.top_k if _has_top_k(p, vocab_size) else vocab_size for p in params],
        device=logits.device,
    )
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [N, V]
    rank_from_top = vocab_size - torch.arange(vocab_size, device=logits.device)  # [V]
    outside_top_k = rank_from_top[None, :] > top_k[:, None]  # [N, V]
    sorted_logits = sorted_logits.masked_fill(outside_top_k, -float("inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
    outside_nucleus = cumulative <= (1.0 - top_p[:, None])
    outside_nucleus[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(outside_nucleus, -float("inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: Tensor, params: list[SamplingParams]) -> Tensor:  # [N, V]
    """Drop tokens below min_p times the row's top probability, renormalize."""
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)  # [N]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [N, 1]
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(
    probs: Tensor,  # [N, V]
    generators: list[torch.Generator | None],  # one per row; None: the default generator
) -> list[int]:
    """Exponential race: argmax(p / E), E ~ Exp(1), picks token t with probability p[t]."""
    return race(probs, exponential_noise(probs, generators)).tolist()


def exponential_noise(
    like: Tensor,  # [N, V]
    generators: list[torch.Generator | None],
) -> Tensor:  # [N, V] Exp(1) draws, each seeded row from its own generator
    noise = torch.empty_like(like, dtype=torch.float32)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_()
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    return noise


def race(probs: Tensor, noise: Tensor) -> Tensor:  # [..., V], [..., V] -> [...] token ids
    # A zero draw would turn a zero-probability token into 0/0 = nan, which argmax may pick.
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def logprobs_of(
    logits: Tensor,  # [N, V] raw logits
    token_ids: list[int],  # one chosen token per row
    num_top: int,
) -> list[TokenLogprob]:
    """The model's own log-distribution (before any sampling transform): chosen + top-n."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    index = torch.tensor(token_ids, device=logits.device)[:, None]
    chosen = logprobs.gather(1, index).squeeze(1).tolist()  # [N]
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(token_ids)
    if num_top > 0:
        top_vals, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)  # [N, n]
        pairs = zip(top_ids.tolist(), top_vals.tolist(), strict=True)
        tops = [tuple(zip(i, v, strict=True)) for i, v in pairs]
    return [
        TokenLogprob(token_id=t, logprob=lp, top=top)
        for t, lp, top in zip(token_ids, chosen, tops, strict=True)
    ]


def _one_hot_argmax(logits: Tensor) -> Tensor:  # [N, V] -> [N, V]
    probs = torch.zeros_like(logits)
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _has_top_k(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size
