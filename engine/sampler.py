"""Stateless sampling: penalties, temperature, top-k/top-p/min-p, sampling and logprobs.

Every function works on a batch of rows, one row per (request, position). Rows are
independent: a row's result never depends on the other rows in the batch, which is what
makes seeded sampling reproducible whatever the batch composition.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

# Sorting a 150k vocabulary costs tens of ms per row on CPU, while a top-p nucleus almost
# always lies within the best few hundred tokens: look at these first, sort all only if needed.
NUCLEUS_CANDIDATES = 1024


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
    """OpenAI semantics: logit[t] -= presence * (count[t] > 0) + frequency * count[t].

    Touches only the (row, token) pairs that occur: no [N, V] count table."""
    rows, ids = _penalized_pairs(params, output_token_ids)
    if not ids:
        return logits
    vocab_size = logits.shape[1]
    keys = torch.tensor(rows, device=logits.device) * vocab_size
    keys, counts = (keys + torch.tensor(ids, device=logits.device)).unique(return_counts=True)
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)
    key_rows = keys // vocab_size  # [M]
    logits = logits.clone(memory_format=torch.contiguous_format)
    logits.view(-1)[keys] -= presence[key_rows] + frequency[key_rows] * counts
    return logits


def _penalized_pairs(
    params: list[SamplingParams], output_token_ids: list[list[int]]
) -> tuple[list[int], list[int]]:
    """(row, token) for every generated token of every row that has penalties."""
    rows: list[int] = []
    ids: list[int] = []
    for i, (p, toks) in enumerate(zip(params, output_token_ids, strict=True)):
        if p.has_penalties:
            rows += [i] * len(toks)
            ids += toks
    return rows, ids


def verification_histories(
    output_token_ids: list[int], draft_token_ids: list[int]
) -> list[list[int]]:
    """Penalty histories for verifying k drafts: row i counts the drafts before position i."""
    return [output_token_ids + draft_token_ids[:i] for i in range(len(draft_token_ids) + 1)]


def apply_top_k_top_p(logits: Tensor, params: list[SamplingParams]) -> Tensor:  # [N, V]
    """Mask everything outside each row's top-k, then outside its top-p nucleus."""
    vocab_size = logits.shape[1]
    top_ks = [p.top_k if _has_top_k(p, vocab_size) else vocab_size for p in params]
    top_k = torch.tensor(top_ks, device=logits.device)  # [N], V where off
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)  # [N]
    num_candidates = max([NUCLEUS_CANDIDATES, *(k for k in top_ks if k < vocab_size)])
    if num_candidates < vocab_size:
        masked = _keep_top_k_top_p(logits, top_k, top_p, num_candidates)
        if masked is not None:
            return masked
    masked = _keep_top_k_top_p(logits, top_k, top_p, vocab_size)
    assert masked is not None
    return masked


def _keep_top_k_top_p(
    logits: Tensor,  # [N, V]
    top_k: Tensor,  # [N], V where off
    top_p: Tensor,  # [N]
    num_candidates: int,
) -> Tensor | None:  # [N, V]; None when a nucleus reaches past the candidates
    vocab_size = logits.shape[1]
    values, order = _best(logits, num_candidates)  # [N, C], best first
    rank = torch.arange(num_candidates, device=logits.device)
    values = values.masked_fill(rank[None, :] >= top_k[:, None], -float("inf"))
    has_top_k = top_k < vocab_size
    log_norm = torch.where(has_top_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - log_norm[:, None]).exp()  # [N, C], renormalized over the top-k if any
    untouched = ~has_top_k & (top_p >= 1.0)
    covered = has_top_k | untouched | (probs.sum(dim=-1) >= top_p)
    if num_candidates < vocab_size and not bool(covered.all()):
        return None
    # top_p == 1 keeps everything, even where a float cumsum overshoots 1.
    threshold = torch.where(top_p >= 1.0, float("inf"), top_p)  # [N]
    mass_before = probs.cumsum(dim=-1) - probs  # [N, C]
    values = values.masked_fill(mass_before >= threshold[:, None], -float("inf"))
    masked = torch.full_like(logits, -float("inf")).scatter_(1, order, values)
    return torch.where(untouched[:, None], logits, masked)


def _best(logits: Tensor, num: int) -> tuple[Tensor, Tensor]:  # [N, V] -> 2 x [N, num]
    if num >= logits.shape[1]:
        return logits.sort(dim=-1, descending=True)
    return logits.topk(num, dim=-1)


def apply_min_p(probs: Tensor, params: list[SamplingParams]) -> Tensor:  # [N, V]
    """Drop tokens below min_p times the row's top probability, renormalize."""
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)  # [N]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [N, 1]
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(
    probs: Tensor,  # [N, V]
    generators: Sequence[torch.Generator | None],  # per row; None: the default generator
) -> list[int]:
    """Exponential race: argmax(p / E), E ~ Exp(1), picks token t with probability p[t].

    One-hot rows (greedy) take their argmax without drawing anything."""
    ids = probs.argmax(dim=-1)  # [N]
    random_rows: list[int] = (probs.amax(dim=-1) < 1.0).nonzero().flatten().tolist()
    if random_rows:
        rows = probs[random_rows]  # [R, V]
        noise = exponential_noise(rows.shape, [generators[i] for i in random_rows], rows.device)
        ids[random_rows] = race(rows, noise)
    return ids.tolist()


def exponential_noise(
    shape: torch.Size,  # [R, V]
    generators: Sequence[torch.Generator | None],  # one per row
    device: torch.device,
) -> Tensor:  # [R, V] Exp(1) draws, each seeded row from its own generator
    unseeded = [i for i, g in enumerate(generators) if g is None]
    noise = torch.empty(shape, device=device)
    if unseeded:
        noise[unseeded] = exponential((len(unseeded), shape[1]), None, device)
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i] = exponential((shape[1],), gen, device)
    return noise


def exponential(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """Exp(1) as -log(1 - U): several times cheaper on CPU than Tensor.exponential_."""
    uniform = torch.rand(shape, generator=generator, device=device)  # [0, 1)
    return uniform.neg_().add_(1.0).log_().neg_()


def race(probs: Tensor, noise: Tensor) -> Tensor:  # [..., V], [..., V] -> [...] token ids
    """argmax(probs / noise), computed in noise's memory (noise is used up)."""
    # A zero draw would turn a zero-probability token into 0/0 = nan, which argmax may pick.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return torch.div(probs, noise, out=noise).argmax(dim=-1)


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
