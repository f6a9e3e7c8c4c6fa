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

Seeded requests verify by sample-and-match instead (engine/sample/seeded.py): the target's token
at position i is argmax(p_i / E_i) under that position's own noise E_i, a function of (seed,
choice, position) only; draft x_i is accepted iff it equals that token, the first mismatch is
replaced by it, and the bonus is the one after the last draft. Each emitted token is then exactly
the token plain decoding would sample, whatever was drafted (greedy is the same rule with E = 1).

`verify_batch` verifies a whole step at once in vLLM's flattened layout: request b has k_b drafts
and k_b + 1 verify rows (one per draft, then the bonus row), stacked request after request into
one [num_tokens, V] tensor; `cu_num_draft_tokens` holds the cumulative k_b. `verify` and
`verify_seeded` (one request) are the references it must equal for greedy and seeded requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from engine.sample.sampler import (
    SamplingTensors,
    apply_penalties,
    exponential,
    probs_from_logits,
    uniform,
    verification_penalty_pairs,
)
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import gumbel_max, race


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
    return _match(target_probs.argmax(dim=-1).tolist(), draft_token_ids)


def verify_seeded(
    target_probs: Tensor,  # [k+1, V] processed target probs at each draft position + bonus
    draft_token_ids: list[int],  # k proposed tokens
    row_keys: list[int],  # [k+1] the seeded noise keys of those output positions
) -> list[int]:
    """Sample-and-match: the drafts that equal the target's Gumbel-max tokens, then its next one."""
    return _match(gumbel_max(target_probs, row_keys).tolist(), draft_token_ids)


def _match(target_ids: list[int], draft_token_ids: list[int]) -> list[int]:  # [k+1], [k]
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


# ---- one batched verification per step ---------------------------------------------------------


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """Where each request's drafts and verify rows sit in the step's flattened tensors."""

    num_draft_tokens: list[int]  # [batch] k_b
    first_rows: list[int]  # [batch] first verify row of each request; its bonus row is first + k_b
    draft_token_ids: Tensor  # [num_draft_tokens] long, request after request
    cu_num_draft_tokens: Tensor  # [batch] long: request b's drafts end here (vLLM's layout)
    draft_request: Tensor  # [num_draft_tokens] the request of each draft
    draft_position: Tensor  # [num_draft_tokens] its position 0..k_b-1 within the request
    target_rows: Tensor  # [num_draft_tokens] the verify row that scores each draft

    @staticmethod
    def from_drafts(draft_token_ids: list[list[int]], device: torch.device) -> SpecDecodeMetadata:
        num_draft = [len(d) for d in draft_token_ids]
        cu = list(accumulate(num_draft))
        request = [b for b, k in enumerate(num_draft) for _ in range(k)]
        position = [i for k in num_draft for i in range(k)]
        columns = [
            [t for d in draft_token_ids for t in d],
            request,
            position,
            [j + b for j, b in enumerate(request)],
        ]
        table = torch.tensor(columns, dtype=torch.long, device=device)  # [4, num_draft_tokens]
        return SpecDecodeMetadata(
            num_draft_tokens=num_draft,
            first_rows=[c - k + b for b, (c, k) in enumerate(zip(cu, num_draft, strict=True))],
            draft_token_ids=table[0],
            cu_num_draft_tokens=torch.tensor(cu, dtype=torch.long, device=device),
            draft_request=table[1],
            draft_position=table[2],
            target_rows=table[3],
        )

    @property
    def batch_size(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.draft_token_ids) + self.batch_size

    def drafts_of(self, b: int) -> slice:
        """Request b's entries in the [num_draft_tokens] tensors."""
        start = self.first_rows[b] - b
        return slice(start, start + self.num_draft_tokens[b])


# On a CPU a pass over [rows, V] streams from memory once the rows outgrow the cache, and verify
# makes a dozen such passes: there requests go in groups whose rows fit. A GPU takes one group.
CPU_GROUP_BYTES = 8 << 20


def verify_batch(
    target_logits: Tensor,  # [num_tokens, V] raw target logits: k_b + 1 verify rows per request
    draft_token_ids: list[list[int]],  # [batch] the k_b drafts of each request
    draft_probs: list[Tensor | None],  # [batch] [k_b, V] draft probs; None: one-hot (n-gram)
    params: list[SamplingParams],  # [batch]
    output_token_ids: list[list[int]],  # [batch] tokens so far; read only where penalties apply
    seeded_rows: Sequence[list[int] | None],  # [batch] a seeded request's k_b + 1 row keys
) -> list[list[int]]:  # [batch] accepted drafts + one recovered or bonus token
    """Verify a step's requests together: penalties, sampling transforms, rejection sampling,
    then one copy to the host."""
    num_rows = [len(d) + 1 for d in draft_token_ids]
    if not num_rows:
        return []
    if target_logits.shape[0] != sum(num_rows):
        raise ValueError(
            f"{target_logits.shape[0]} verify rows for {sum(num_rows)} (drafts + 1 per request)"
        )
    width = max(num_rows)
    output = torch.full((len(num_rows), width), -1, dtype=torch.long, device=target_logits.device)
    first_row = 0
    for group in _groups(num_rows, target_logits, params):
        group_rows = sum(num_rows[group])
        tokens = _verify_group(
            target_logits[first_row : first_row + group_rows],
            draft_token_ids[group],
            draft_probs[group],
            params[group],
            output_token_ids[group],
            seeded_rows[group],
        )
        output[group, : tokens.shape[1]] = tokens
        first_row += group_rows
    return [row[: row.index(-1)] if -1 in row else row for row in output.tolist()]


def _groups(
    num_rows: list[int], target_logits: Tensor, params: list[SamplingParams]
) -> list[slice]:
    """Consecutive requests whose verify rows fit CPU_GROUP_BYTES; one group on a GPU, or when
    all are greedy (a single argmax pass)."""
    if target_logits.device.type != "cpu" or all(p.greedy for p in params):
        return [slice(0, len(num_rows))]
    budget = max(1, CPU_GROUP_BYTES // (4 * target_logits.shape[1]))  # rows of float32
    groups, start, rows = [], 0, 0
    for b, n in enumerate(num_rows):
        if rows and rows + n > budget:
            groups.append(slice(start, b))
            start, rows = b, 0
        rows += n
    return [*groups, slice(start, len(num_rows))]


def _verify_group(
    target_logits: Tensor,  # [num_tokens, V] raw target logits of the group's verify rows
    draft_token_ids: list[list[int]],  # [batch]
    draft_probs: list[Tensor | None],  # [batch] [k_b, V]
    params: list[SamplingParams],  # [batch]
    output_token_ids: list[list[int]],  # [batch]
    seeded_rows: Sequence[list[int] | None],  # [batch]
) -> Tensor:  # [batch, max_k + 1] output token ids padded with -1
    device, vocab_size = target_logits.device, target_logits.shape[1]
    metadata = SpecDecodeMetadata.from_drafts(draft_token_ids, device)
    row_params = [
        p for p, k in zip(params, metadata.num_draft_tokens, strict=True) for _ in range(k + 1)
    ]
    sampling = SamplingTensors.from_params(row_params, vocab_size, device)
    logits = target_logits.float()
    if sampling.do_penalties:
        penalized = [b for b, p in enumerate(params) if p.has_penalties]
        rows, ids = verification_penalty_pairs(
            [metadata.first_rows[b] for b in penalized],
            [output_token_ids[b] for b in penalized],
            [draft_token_ids[b] for b in penalized],
        )
        logits = apply_penalties(logits, sampling, rows, ids)
    output, _ = rejection_sample(logits, sampling, metadata, draft_probs, seeded_rows)
    return output


def rejection_sample(
    target_logits: Tensor,  # [num_tokens, V] float32, penalties applied
    sampling: SamplingTensors,  # num_tokens rows
    metadata: SpecDecodeMetadata,
    draft_probs: list[Tensor | None],  # [batch] [k_b, V]; None: one-hot drafts
    seeded_rows: Sequence[list[int] | None],  # [batch] a seeded request's k_b + 1 row keys
) -> tuple[Tensor, Tensor]:  # output token ids [batch, max_k + 1], num_accepted [batch]
    """Accepted drafts, then a recovered token at the first rejection or a bonus token after all
    k_b; the output rows are padded with -1.

    Greedy and seeded requests verify by matching: the target's own token at each verify row (its
    argmax, or the Gumbel-max under that position's seeded noise) accepts the draft there iff they
    are equal, and is the recovered or bonus token; so they emit exactly what plain decoding
    would. Unseeded sampled requests take rejection sampling, which accepts the most.

    The draft probs stay per request, as proposers hand them over: verification reads only q at
    each draft and one row per request, so stacking all [num_draft_tokens, V] would be a copy."""
    m, device = metadata, target_logits.device
    greedy = [sampling.is_greedy[m.first_rows[b]] for b in range(m.batch_size)]
    seeded = [b for b, g in enumerate(greedy) if not g and seeded_rows[b] is not None]
    rejecting = [b for b, g in enumerate(greedy) if not g and seeded_rows[b] is None]
    target_probs = probs_from_logits(target_logits, sampling) if seeded or rejecting else None
    own = _own_tokens(target_logits, target_probs, m, any(greedy), seeded, seeded_rows)
    accepted = torch.zeros(len(m.draft_token_ids), dtype=torch.bool, device=device)
    if own is not None:
        accepted = m.draft_token_ids == own[m.target_rows]  # [num_draft_tokens]
    if rejecting:
        assert target_probs is not None
        uniforms = uniform((len(m.draft_token_ids),), None, device)  # [num_draft_tokens]
        q = _draft_probs_at_drafts(draft_probs, m)  # [num_draft_tokens]
        stochastic = _accept_sampled(target_probs, m, q, uniforms)
        matching = torch.tensor([b not in rejecting for b in range(m.batch_size)], device=device)
        accepted = accepted.where(matching[m.draft_request], stochastic)
    num_accepted = _num_accepted(accepted, m)  # [batch]
    if own is None:
        final = torch.empty(m.batch_size, dtype=torch.long, device=device)
    else:  # the target's own token at the first mismatch or after k
        final = own[torch.tensor(m.first_rows, device=device) + num_accepted]  # [batch]
    if rejecting:
        assert target_probs is not None
        recovered_or_bonus = _recover_or_bonus(
            target_probs, m, draft_probs, num_accepted, rejecting
        )
        final[torch.tensor(rejecting, device=device)] = recovered_or_bonus
    return _output_token_ids(m, num_accepted, final), num_accepted


def _own_tokens(
    target_logits: Tensor,  # [num_tokens, V]
    target_probs: Tensor | None,  # [num_tokens, V] processed; None when nothing samples
    m: SpecDecodeMetadata,
    any_greedy: bool,
    seeded: list[int],  # the seeded sampled requests
    seeded_rows: Sequence[list[int] | None],  # [batch]
) -> Tensor | None:  # [num_tokens] the target's own token where a request matches; None: none do
    if not any_greedy and not seeded:
        return None
    if any_greedy:
        own = target_logits.argmax(dim=-1)  # [num_tokens]
    else:
        own = torch.empty(target_logits.shape[0], dtype=torch.long, device=target_logits.device)
    if seeded:
        assert target_probs is not None
        rows: list[int] = []
        keys: list[int] = []
        for b in seeded:
            first, num_rows = m.first_rows[b], m.num_draft_tokens[b] + 1
            row_keys = seeded_rows[b] or []
            if len(row_keys) != num_rows:
                raise ValueError(f"{len(row_keys)} seeded row keys for {num_rows} verify rows")
            rows += range(first, first + num_rows)
            keys += row_keys
        index = torch.tensor(rows, device=own.device)
        own[index] = gumbel_max(target_probs[index], keys)
    return own


def _draft_probs_at_drafts(
    draft_probs: list[Tensor | None],  # [batch] [k_b, V]; None: one-hot drafts
    m: SpecDecodeMetadata,
) -> Tensor:  # [num_draft_tokens] q(x_i): 1 for a one-hot draft
    q = torch.ones(len(m.draft_token_ids), device=m.draft_token_ids.device)
    for b, probs in enumerate(draft_probs):
        if probs is not None and m.num_draft_tokens[b]:
            ids = m.draft_token_ids[m.drafts_of(b), None]  # [k_b, 1]
            q[m.drafts_of(b)] = probs.to(q.device).gather(1, ids).squeeze(1).float()
    return q


def _accept_sampled(
    target_probs: Tensor,  # [num_tokens, V]
    m: SpecDecodeMetadata,
    q: Tensor,  # [num_draft_tokens] the draft's probability of each draft
    uniforms: Tensor,  # [num_draft_tokens]
) -> Tensor:  # [num_draft_tokens] bool
    p = target_probs[m.target_rows, m.draft_token_ids]  # [num_draft_tokens]
    # u < p/q without dividing: q == 0 < p accepts, p == 0 always rejects.
    return uniforms * q < p


def _num_accepted(
    accepted: Tensor,  # [num_draft_tokens] bool
    m: SpecDecodeMetadata,
) -> Tensor:  # [batch]
    """Drafts accepted before each request's first rejection."""
    max_k = max(m.num_draft_tokens, default=0)
    padded = torch.zeros(m.batch_size, max_k, dtype=torch.bool, device=accepted.device)
    padded[m.draft_request, m.draft_position] = accepted  # [batch, max_k], False past k_b
    return padded.long().cumprod(dim=-1).sum(dim=-1)


def _recover_or_bonus(
    target_probs: Tensor,  # [num_tokens, V]
    m: SpecDecodeMetadata,
    draft_probs: list[Tensor | None],  # [batch] [k_b, V]; None: one-hot drafts
    num_accepted: Tensor,  # [batch]
    sampled: list[int],  # the S requests that sample
) -> Tensor:  # [S] token ids
    """Draw from norm(max(0, p - q)) at the first rejection, from p after all k were accepted."""
    device = target_probs.device
    index = torch.tensor(sampled, device=device)  # [S]
    a = num_accepted[index]  # [S]
    dist = target_probs[torch.tensor(m.first_rows, device=device)[index] + a]  # [S, V]
    if len(m.draft_token_ids) > 0:
        k = torch.tensor([m.num_draft_tokens[b] for b in sampled], device=device)  # [S]
        position = torch.minimum(a, k - 1).clamp_min(0)  # [S] the rejected draft, where a < k
        q = _draft_rows(draft_probs, m, sampled, position, dist)  # [S, V]
        residual = (dist - q).clamp_min(0.0)  # [S, V]
        # p == q leaves nothing to recover from (only reached by float error): fall back to p.
        use_target = (a == k) | (residual.sum(dim=-1) <= 0.0)  # [S]
        dist = torch.where(use_target[:, None], dist, residual)
    noise = exponential(tuple(dist.shape), None, device)  # [S, V]
    return race(dist, noise)


def _draft_rows(
    draft_probs: list[Tensor | None],  # [batch] [k_b, V]; None: one-hot drafts
    m: SpecDecodeMetadata,
    sampled: list[int],  # [S]
    position: Tensor,  # [S] a draft position within each request (0 where it has none)
    dist: Tensor,  # [S, V] for shape and device
) -> Tensor:  # [S, V] each request's q at that position: one-hot for n-gram drafts
    """Each row written once: a request with draft probs copies its row, the rest are one-hot."""
    q = torch.empty_like(dist)
    one_hot = []
    for s, b in enumerate(sampled):
        probs = draft_probs[b]
        if probs is not None and m.num_draft_tokens[b]:
            torch.index_select(probs.to(q), 0, position[s : s + 1], out=q[s : s + 1])
        else:
            one_hot.append(s)
    if one_hot:
        rows = torch.tensor(one_hot, device=q.device)  # [H]
        first_drafts = torch.tensor([m.first_rows[sampled[s]] - sampled[s] for s in one_hot])
        drafted = (first_drafts.to(q.device) + position[rows]).clamp(max=len(m.draft_token_ids) - 1)
        q[rows] = 0.0
        q[rows, m.draft_token_ids[drafted]] = 1.0
    return q


def _output_token_ids(
    m: SpecDecodeMetadata,
    num_accepted: Tensor,  # [batch]
    final: Tensor,  # [batch] recovered or bonus token
) -> Tensor:  # [batch, max_k + 1]: accepted drafts, the final token, then -1
    max_k = max(m.num_draft_tokens, default=0)
    out = torch.full((m.batch_size, max_k + 1), -1, dtype=torch.long, device=final.device)
    out[m.draft_request, m.draft_position] = m.draft_token_ids
    cols = torch.arange(max_k + 1, device=final.device)[None, :]  # [1, max_k + 1]
    out = out.masked_fill(cols >= num_accepted[:, None], -1)
    return out.scatter_(1, num_accepted[:, None], final[:, None])
