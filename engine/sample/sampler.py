"""Stateless sampling: penalties, temperature, top-k/top-p/min-p, sampling and logprobs.

Every function works on a batch of rows, one row per (request, position). Rows are
independent: a row's result never depends on the other rows in the batch, which is what
makes seeded sampling reproducible whatever the batch composition.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.model import device as devices
from engine.outputs import TokenLogprob
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import gumbel_max, race

# Sorting a 150k vocabulary costs tens of ms per row on CPU, while a top-p nucleus almost
# always lies within the best few hundred tokens: look at these first, sort all only if needed.
NUCLEUS_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingTensors:
    """A batch's sampling parameters as tensors, one entry per row, built once per step.

    The flags say on the host which transforms any row needs, so none costs a sync."""

    temperature: Tensor  # [N] float32, 1.0 on greedy rows
    top_k: Tensor  # [N] long, vocab_size where off
    top_p: Tensor  # [N]
    min_p: Tensor  # [N]
    presence_penalty: Tensor  # [N]
    frequency_penalty: Tensor  # [N]
    greedy: Tensor  # [N] bool
    is_greedy: tuple[bool, ...]  # [N] the same, on the host
    max_top_k: int  # the largest top-k that is on; 0 when none is
    do_top_k_top_p: bool
    do_min_p: bool
    do_penalties: bool

    @staticmethod
    def from_params(
        params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
    ) -> SamplingTensors:
        top_ks = [p.top_k if _has_top_k(p, vocab_size) else vocab_size for p in params]
        columns = [
            [p.temperature or 1.0 for p in params],
            [float(k) for k in top_ks],  # exact in float32 below 2**24
            [p.top_p for p in params],
            [p.min_p for p in params],
            [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params],
            [float(p.greedy) for p in params],
        ]
        table = torch.tensor(columns, dtype=torch.float32, device=device)  # [7, N]: one copy
        max_top_k = max((k for k in top_ks if k < vocab_size), default=0)
        return SamplingTensors(
            temperature=table[0],
            top_k=table[1].long(),
            top_p=table[2],
            min_p=table[3],
            presence_penalty=table[4],
            frequency_penalty=table[5],
            greedy=table[6] > 0.0,
            is_greedy=tuple(p.greedy for p in params),
            max_top_k=max_top_k,
            do_top_k_top_p=max_top_k > 0 or any(p.top_p < 1.0 for p in params),
            do_min_p=any(p.min_p > 0.0 for p in params),
            do_penalties=any(p.has_penalties for p in params),
        )

    @property
    def all_greedy(self) -> bool:
        return all(self.is_greedy)


def processed_probs(
    logits: Tensor,  # [N, V] float32 raw logits
    params: list[SamplingParams],  # one per row
    output_token_ids: list[list[int]],  # tokens generated so far per row (may include drafts)
) -> Tensor:  # [N, V] float32 probabilities; greedy rows are one-hot on the argmax
    sampling = SamplingTensors.from_params(params, logits.shape[1], logits.device)
    logits = logits.float()
    if sampling.do_penalties:
        rows, ids = _penalized_pairs(params, output_token_ids)
        pairs = torch.tensor([rows, ids], dtype=torch.long)  # [2, M]
        logits = apply_penalties(logits, sampling, pairs[0], pairs[1])
    return probs_from_logits(logits, sampling)


def probs_from_logits(
    logits: Tensor,  # [N, V] float32, penalties applied
    sampling: SamplingTensors,  # N rows
) -> Tensor:  # [N, V] float32 probabilities; greedy rows are one-hot on the argmax
    """Temperature, top-k, top-p, softmax, min-p: the distribution each row samples from."""
    if sampling.all_greedy:
        return _one_hot_argmax(logits)
    greedy_probs = _one_hot_argmax(logits) if any(sampling.is_greedy) else None
    logits = logits / sampling.temperature[:, None]
    if sampling.do_top_k_top_p:
        logits = apply_top_k_top_p(logits, sampling)
    probs = torch.softmax(logits, dim=-1)  # [N, V]
    if sampling.do_min_p:
        probs = apply_min_p(probs, sampling)
    if greedy_probs is not None:
        probs = torch.where(sampling.greedy[:, None], greedy_probs, probs)
    return probs


def apply_penalties(
    logits: Tensor,  # [N, V]
    sampling: SamplingTensors,  # N rows
    rows: Tensor,  # [M] long, on the CPU: the row of each counted token
    token_ids: Tensor,  # [M] long, on the CPU: the token
) -> Tensor:  # [N, V], a copy when anything changes
    """OpenAI semantics: logit[t] -= presence * (count[t] > 0) + frequency * count[t].

    Touches only the (row, token) pairs that occur: no [N, V] count table. The pairs are counted
    on the host, where they come from, so the device never waits on `unique`."""
    if rows.numel() == 0:
        return logits
    vocab_size = logits.shape[1]
    keys, counts = (rows * vocab_size + token_ids).unique(return_counts=True)  # [M'] each
    keys, counts = keys.to(logits.device), counts.to(logits.device)
    key_rows = keys // vocab_size  # [M']
    penalty = sampling.presence_penalty[key_rows] + sampling.frequency_penalty[key_rows] * counts
    logits = logits.clone(memory_format=torch.contiguous_format)
    logits.view(-1)[keys] -= penalty
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


def verification_penalty_pairs(
    first_rows: list[int],  # each penalized request's first verify row
    output_token_ids: list[list[int]],  # its tokens generated so far
    draft_token_ids: list[list[int]],  # its drafts
) -> tuple[Tensor, Tensor]:  # rows [M], token ids [M] (CPU, long)
    """The (row, token) pairs of verification_histories, built without copying histories:
    verify row i of a request counts its output and its drafts before position i."""
    rows, ids = [torch.empty(0, dtype=torch.long)], [torch.empty(0, dtype=torch.long)]
    for first, output, drafts in zip(first_rows, output_token_ids, draft_token_ids, strict=True):
        num_rows = len(drafts) + 1
        out = torch.tensor(output, dtype=torch.long)  # [L]
        rows.append(torch.arange(first, first + num_rows).repeat_interleave(len(output)))
        ids.append(out.repeat(num_rows))
        row, col = torch.tril_indices(num_rows, len(drafts), offset=-1)  # pairs col < row
        rows.append(first + row)
        ids.append(torch.tensor(drafts, dtype=torch.long)[col])
    return torch.cat(rows), torch.cat(ids)


def apply_top_k_top_p(logits: Tensor, sampling: SamplingTensors) -> Tensor:  # [N, V]
    """Mask everything outside each row's top-k, then outside its top-p nucleus."""
    vocab_size = logits.shape[1]
    num_candidates = max(NUCLEUS_CANDIDATES, sampling.max_top_k)
    # The candidates' shortcut asks the host whether they cover each nucleus: a sync, free only
    # on a CPU (where it saves sorting the vocabulary); a GPU sorts it faster than it would wait.
    if num_candidates < vocab_size and devices.host_syncs_free(logits.device):
        masked = _keep_top_k_top_p(logits, sampling.top_k, sampling.top_p, num_candidates)
        if masked is not None:
            return masked
    masked = _keep_top_k_top_p(logits, sampling.top_k, sampling.top_p, vocab_size)
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


def apply_min_p(probs: Tensor, sampling: SamplingTensors) -> Tensor:  # [N, V]
    """Drop tokens below min_p times the row's top probability, renormalize."""
    threshold = sampling.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [N, 1]
    probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(
    probs: Tensor,  # [N, V]
    row_keys: Sequence[int | None],  # per row: a seeded row's noise key; None: the default RNG
) -> list[int]:
    """Exponential race: argmax(p / E), E ~ Exp(1), picks token t with probability p[t]. A seeded
    row takes E from its position's counter-based noise (engine/sample/seeded.py), so its token
    depends on its probabilities and key alone, never on the other rows or the RNG's state.

    One-hot rows (greedy) take their argmax without drawing anything."""
    ids = probs.argmax(dim=-1)  # [N]
    random_rows: list[int] = (probs.amax(dim=-1) < 1.0).nonzero().flatten().tolist()
    return race_rows(probs, ids, random_rows, row_keys).tolist()


def sample_on_device(
    probs: Tensor,  # [N, V]
    is_greedy: Sequence[bool],  # [N] from each row's parameters (on the host)
    row_keys: Sequence[int | None],  # per row: a seeded row's noise key; None: the default RNG
) -> Tensor:  # [N] long token ids, on probs' device
    """`sample` without reading the probs on the host: rows greedy by their parameters take the
    argmax, the others race (a row that is one-hot anyway still picks its one token)."""
    ids = probs.argmax(dim=-1)  # [N]
    random_rows = [i for i, greedy in enumerate(is_greedy) if not greedy]
    return race_rows(probs, ids, random_rows, row_keys)


def race_rows(
    probs: Tensor,  # [N, V]
    ids: Tensor,  # [N] the argmax, overwritten in the random rows
    random_rows: list[int],
    row_keys: Sequence[int | None],  # [N]
) -> Tensor:  # [N] long
    """The random rows' exponential race: seeded rows on their position's counter-based noise,
    the others on the default RNG."""
    seeded = [i for i in random_rows if row_keys[i] is not None]
    unseeded = [i for i in random_rows if row_keys[i] is None]
    if unseeded:
        rows = probs[unseeded]  # [U, V]
        ids[unseeded] = race(rows, exponential(tuple(rows.shape), None, rows.device))
    if seeded:
        ids[seeded] = gumbel_max(probs[seeded], [row_keys[i] or 0 for i in seeded])
    return ids


def exponential(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """Exp(1) as -log(1 - U): several times cheaper on CPU than Tensor.exponential_."""
    return uniform(shape, generator, device).neg_().add_(1.0).log_().neg_()


def uniform(
    shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device
) -> Tensor:  # U[0, 1) on device, drawn where the generator lives (a request's is on the CPU)
    if generator is None:
        return torch.rand(shape, device=device)
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def logprobs_of(
    logits: Tensor,  # [N, V] raw logits
    token_ids: list[int],  # one chosen token per row
    num_top: int,
) -> list[TokenLogprob]:
    """The model's own log-distribution (before any sampling transform): chosen + top-n."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    index = torch.tensor(token_ids, device=logits.device)[:, None]
    columns = [logprobs.gather(1, index)]  # [N, 1]: the chosen token's
    n = min(num_top, logprobs.shape[1])
    if n > 0:
        top_vals, top_ids = logprobs.topk(n, dim=-1)  # [N, n] each
        columns += [top_vals, top_ids.float()]  # ids < 2**24: exact in float32
    table = torch.cat(columns, dim=1).tolist()  # [N, 1 + 2n]: one copy to the host
    chosen = [row[0] for row in table]
    tops: list[tuple[tuple[int, float], ...]] = [
        tuple(zip(map(int, row[1 + n :]), row[1 : 1 + n], strict=True)) for row in table
    ]
    return [
        TokenLogprob(token_id=t, logprob=lp, top=top)
        for t, lp, top in zip(token_ids, chosen, tops, strict=True)
    ]


def _one_hot_argmax(logits: Tensor) -> Tensor:  # [N, V] -> [N, V]
    probs = torch.zeros_like(logits)
    return probs.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _has_top_k(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size


def emitted_logprobs(
    num_logprobs: list[int | None],  # [batch] each request's `logprobs` (None: it wants none)
    target_logits: Tensor,  # [num_tokens, vocab_size]: len(drafts[b]) + 1 verify rows per request
    drafts: list[list[int]],
    tokens: list[list[int]],  # the tokens each request emits
) -> list[list[TokenLogprob] | None]:
    """Logprobs of the emitted tokens, for the requests that ask, in one pass."""
    wanted = [j for j, n in enumerate(num_logprobs) if n is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(num_logprobs)
    if not wanted:
        return out
    first_rows = [0]
    for d in drafts:
        first_rows.append(first_rows[-1] + len(d) + 1)
    rows = [first_rows[j] + i for j in wanted for i in range(len(tokens[j]))]
    num_top = max(num_logprobs[j] or 0 for j in wanted)
    flat = logprobs_of(target_logits[rows], [t for j in wanted for t in tokens[j]], num_top)
    start = 0
    for j in wanted:
        own = num_logprobs[j] or 0
        run = flat[start : start + len(tokens[j])]
        out[j] = [dataclasses.replace(lp, top=lp.top[:own]) for lp in run]
        start += len(tokens[j])
    return out
