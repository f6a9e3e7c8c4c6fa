"""Paged attention over a block-addressed KV pool: one attention call per layer per group.

K/V for position p of a request lives at slot `block_table[p // block_size] * block_size +
p % block_size`. A forward writes its new tokens' K/V at their slots, then gathers each
request's whole context through its block table into a padded batch and attends with a
causal + padding mask. Requests are grouped so that one long prefill chunk does not pad every
single-token decode in the batch up to its length: short queries (decodes, k+1 verify queries)
share one group, each long query gets its own.

Long queries go through SDPA. A long query's request whose blocks are one consecutive run of the
pool (the usual case: a prompt's blocks are allocated together) attends to zero-copy views of the
pool instead of a gathered copy (`first_block`); SDPA reads the same values, so the result is the
same. Short ones use eager attention (two batched matmuls, the query heads of a KV head stacked
as rows): CPU SDPA kernels are 10-40x slower for a batch of one-token queries. On a CPU without native bf16 dot products (AVX2) those matmuls run in
float32, 5-10x faster there than bf16 (16 decodes at 300 tokens of context: a 1.5B step
1131 -> 630 ms). The pool is head-major, `[kv_heads, num_blocks, block_size, head_dim]` per
layer for K and for V, so one gather gives contiguous `[kv_heads, batch, len, head_dim]` keys.

On the CPU, short groups skip the gather: the native kernel (engine.kernels.attention_ops)
reads K and V in place through the block tables, when the kernel library is loaded; a draft
tree's rows see their ancestors by bits (`AttentionGroup.tree_bits`, `_with_tree_masks`'s mask).

Sliding-window layers (Gemma 3's local layers) see the same forward through `meta.sliding`:
groups whose masks also hide keys at or before `p - window` from the query at position p, and
whose block tables start at the first block a request's window reaches, so a local layer reads
about `window` keys, not the whole context. Short groups take the native kernel with the window
(it reads only the blocks each query's window reaches); long ones SDPA with the windowed mask.
The pool still holds every position: the window limits what is read, not what is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.kernels import attention_ops

# Queries up to this many tokens (decodes, speculative verify queries) are batched together.
SHORT_QUERY_MAX = 16


@dataclass(frozen=True)
class RequestSpan:
    """One request of a ragged batch, as the attention sees it."""

    start_pos: int  # tokens already in the KV cache
    num_tokens: int  # new tokens in this pass
    block_table: Sequence[int]
    # A draft tree's verify (engine/spec_decode/proposers/tree.py): [num_tokens, num_tokens]
    # bool, which of this pass's tokens each query sees (its ancestors and itself); the cached
    # context is seen whole. None: causal.
    tree_mask: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass(frozen=True)
class AttentionGroup:
    """Requests whose queries are padded into one SDPA call; their tokens are contiguous."""

    token_start: int  # first flat token of the group
    token_end: int
    batch: int  # requests in the group
    max_query_len: int
    block_tables: torch.Tensor  # [batch, max_blocks] int64, padded with block 0
    # Long groups: a bool SDPA mask [batch, 1, max_query_len, kv_len] (None: attend to all).
    # Short groups: an additive float32 bias [batch, 1, max_query_len, kv_len].
    mask: torch.Tensor | None
    query_index: torch.Tensor | None  # [group_tokens] int64 rows of the padded query; None = dense
    # Short groups, for the native kernel (engine.kernels.attention_ops): [batch] int64 each.
    start_pos: torch.Tensor | None = None  # tokens cached before this pass
    query_lens: torch.Tensor | None = None  # new tokens
    # A prompt chunk with nothing cached before it, on a GPU: plain causal attention over its own
    # tokens, SDPA's is_causal with no mask (a mask rules out the flash kernel).
    causal: bool = False
    # A long query whose request's blocks are first_block, first_block + 1, ...: SDPA reads the
    # pool in place through a view (no gather); None when they are not consecutive.
    first_block: int | None = None
    # a sliding-window layer's group: the query at p sees keys (p - window, p]; its block tables
    # start at each request's first block the window reaches (`_blocks_before_window`)
    window: int | None = None
    # a draft tree's rows for the native kernel: bit i of a row's int64 where it sees its request's
    # i-th token of this pass (`_tree_bits`); None: causal
    tree_bits: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionMetadata:
    """Built once per forward and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    groups: tuple[AttentionGroup, ...]
    block_size: int
    # the forward as sliding-window layers see it (same slots, windowed groups); None: no window
    sliding: AttentionMetadata | None = None

    @classmethod
    def build(
        cls,
        spans: Sequence[RequestSpan],
        block_size: int,
        device: torch.device,
        uniform: bool = False,
        sliding_window: int | None = None,
    ) -> AttentionMetadata:
        """`uniform`: short groups always carry a mask and a query index, even where the batch
        needs neither, so that a compiled graph sees one structure for every decode batch.
        `sliding_window`: the model has layers whose query at p sees keys (p - window, p] only;
        `sliding` then describes the forward for them."""
        slots = [_slots(span, block_size) for span in spans]
        slot_mapping = torch.tensor([s for ss in slots for s in ss], dtype=torch.int64)
        slot_mapping = slot_mapping.to(device, non_blocking=True)
        meta = cls(slot_mapping, _groups(spans, block_size, device, uniform, None), block_size)
        if sliding_window is None:
            return meta
        windowed = _groups(spans, block_size, device, uniform, sliding_window)
        return replace(meta, sliding=cls(slot_mapping, windowed, block_size))

    @property
    def short_only(self) -> bool:
        """One group of short queries: a batch of decodes and verify queries, no prefill."""
        return len(self.groups) == 1 and self.groups[0].max_query_len <= SHORT_QUERY_MAX


def _groups(
    spans: Sequence[RequestSpan],
    block_size: int,
    device: torch.device,
    uniform: bool,
    window: int | None,
) -> tuple[AttentionGroup, ...]:
    groups = []
    token_start = 0
    for run in _group_runs(spans):
        groups.append(_build_group(run, token_start, block_size, device, uniform, window))
        token_start += sum(span.num_tokens for span in run)
    return tuple(groups)


def _slots(span: RequestSpan, block_size: int) -> list[int]:
    table = span.block_table
    return [
        table[p // block_size] * block_size + p % block_size
        for p in range(span.start_pos, span.context_len)
    ]


def _group_runs(spans: Sequence[RequestSpan]) -> list[list[RequestSpan]]:
    """Split the batch (in order) into runs: short queries together, each long query alone."""
    runs: list[list[RequestSpan]] = []
    short: list[RequestSpan] = []
    for span in spans:
        if span.num_tokens <= SHORT_QUERY_MAX:
            short.append(span)
            continue
        if short:
            runs.append(short)
            short = []
        runs.append([span])
    if short:
        runs.append(short)
    return runs


def _build_group(
    run: list[RequestSpan],
    token_start: int,
    block_size: int,
    device: torch.device,
    uniform: bool,
    window: int | None,  # keys (p - window, p] only; None: all of (0, p]
) -> AttentionGroup:
    max_q = max(span.num_tokens for span in run)
    skipped = [_blocks_before_window(span, block_size, window) for span in run]
    rows = [
        span.block_table[skip : -(-span.context_len // block_size)]
        for span, skip in zip(run, skipped, strict=True)
    ]
    max_blocks = max(len(row) for row in rows)
    tables = torch.zeros(len(run), max_blocks, dtype=torch.int64)
    for b, row in enumerate(rows):
        tables[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    num_tokens = sum(span.num_tokens for span in run)
    short = max_q <= SHORT_QUERY_MAX
    causal = causal_prefill(device) and not short and len(run) == 1 and run[0].start_pos == 0
    causal = causal and (window is None or run[0].context_len <= window)
    first_keys = [skip * block_size for skip in skipped]
    kv_len = max_blocks * block_size
    trees = any(span.tree_mask is not None for span in run)
    always = (uniform and short) or trees
    mask = None if causal else _mask(run, max_q, kv_len, always, window, first_keys)
    if trees and mask is not None:
        mask = _with_tree_masks(mask, run)
    if short and mask is not None:
        mask = _bias(mask)
    # native: causal within the window (tables from `_blocks_before_window`), a tree by its bits
    native = short
    bits = _tree_bits(run) if native and trees else None
    return AttentionGroup(
        token_start=token_start,
        token_end=token_start + num_tokens,
        batch=len(run),
        max_query_len=max_q,
        block_tables=tables.to(device, non_blocking=True),
        mask=None if mask is None else mask.to(device, non_blocking=True),
        query_index=_query_index(run, max_q, device, always=uniform and short),
        start_pos=_lengths([span.start_pos for span in run], device) if native else None,
        query_lens=_lengths([span.num_tokens for span in run], device) if native else None,
        causal=causal,
        first_block=None if short or len(run) > 1 else _first_of_run(rows[0]),
        window=window,
        tree_bits=None if bits is None else bits.to(device, non_blocking=True),
    )


def _blocks_before_window(span: RequestSpan, block_size: int, window: int | None) -> int:
    """Leading blocks of the context that none of the span's queries sees: all of them lie
    before its first query's window. The group's tables and masks start past them (the native
    kernel computes the same count from start_pos and the window)."""
    return 0 if window is None else max(0, span.start_pos - window + 1) // block_size


def _first_of_run(table: Sequence[int]) -> int | None:
    """The table's first block when its blocks are consecutive in the pool, else None."""
    first = table[0]
    return first if all(b == first + i for i, b in enumerate(table)) else None


def _lengths(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def causal_prefill(device: torch.device) -> bool:
    """Whether a prompt chunk with nothing cached before it drops its mask for is_causal: on a
    GPU, where a mask rules out the flash kernel; not on a CPU, where the masked call rounds bf16
    as transformers does and nothing is gained."""
    return device.type != "cpu"


def _mask(
    run: list[RequestSpan],
    max_q: int,
    kv_len: int,
    always: bool,
    window: int | None = None,
    first_keys: list[int] | None = None,  # each request's position of its context's key 0
) -> torch.Tensor | None:
    """Query j of a request sees keys [0, start_pos + j] (with a window, only the last `window`
    of them); padded query rows see their context's first key only."""
    first = torch.tensor(first_keys or [0] * len(run), dtype=torch.int64)  # [batch]
    sees_all = window is None or run[0].context_len <= window
    one_decode = len(run) == 1 and run[0].num_tokens == 1 and run[0].context_len == kv_len
    if not always and one_decode and sees_all:
        return None
    start = torch.tensor([span.start_pos for span in run], dtype=torch.int64)
    qlen = torch.tensor([span.num_tokens for span in run], dtype=torch.int64)
    j = torch.arange(max_q)
    last_key = start[:, None] + j[None, :]  # [batch, max_q]
    last_key = torch.where(j[None, :] < qlen[:, None], last_key, first[:, None])
    keys = (first[:, None] + torch.arange(kv_len)[None, :])[:, None, :]  # [batch, 1, kv_len]
    mask = keys <= last_key[:, :, None]  # [batch, max_q, kv_len]
    if window is not None:
        mask &= keys > last_key[:, :, None] - window
    return mask[:, None]


def _with_tree_masks(
    mask: torch.Tensor,  # [batch, 1, max_q, kv_len] bool, causal
    run: list[RequestSpan],
) -> torch.Tensor:  # [batch, 1, max_q, kv_len]
    """A tree's queries see the cached context and, of this pass's tokens, their ancestors
    and themselves (sliding-window models draft no trees: keys here start at position 0)."""
    for b, span in enumerate(run):
        if span.tree_mask is not None:
            n, start = span.num_tokens, span.start_pos
            mask[b, 0, :n, start : start + n] = span.tree_mask
    return mask


def _tree_bits(run: list[RequestSpan]) -> torch.Tensor:  # [group_tokens] int64
    """Per query row, which of its request's tokens of this pass it sees, as bits (bit i: the
    pass's i-th token): a tree's ancestors and itself, a chain's tokens up to its own."""
    rows = []
    for span in run:
        n, mask = span.num_tokens, span.tree_mask
        mask = mask if mask is not None else torch.ones(n, n).tril_().bool()
        rows.append((mask.long() << torch.arange(n)).sum(-1))  # bit 63 wraps to int64's sign
    return torch.cat(rows)


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """Bool mask [batch, 1, max_q, kv_len] -> additive float32 bias, 0 or -inf."""
    return torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))


def _query_index(
    run: list[RequestSpan], max_q: int, device: torch.device, always: bool
) -> torch.Tensor | None:
    if not always and all(span.num_tokens == max_q for span in run):
        return None
    index = [b * max_q + j for b, span in enumerate(run) for j in range(span.num_tokens)]
    return torch.tensor(index, dtype=torch.int64).to(device, non_blocking=True)


def write_kv(
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    heads, dim = k.shape[1], k.shape[2]
    k_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,  # [num_heads]: gpt-oss's sink logits
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return attend(q, k_cache, v_cache, meta, scale, sinks)


def attend(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]: this pass's K written
    v_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,  # [num_heads]: gpt-oss's sink logits
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """paged_attention after the new tokens' K/V are in the pool (written by the caller)."""
    outs = [_group_attention(q, k_cache, v_cache, g, scale, sinks) for g in meta.groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _group_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [group_tokens, num_heads * head_dim]
    if sinks is None and group.start_pos is not None and attention_ops.usable(q):
        return _native_attention(q, k_cache, v_cache, group, scale)
    qg = _pad_queries(q[group.token_start : group.token_end], group)  # [B, Q, heads, dim]
    keys = _context(k_cache, group)  # [kv_heads, B, L, dim]
    values = _context(v_cache, group)
    if sinks is not None:  # eager attention, every length: the kernels have no sink column
        assert not group.causal, "attention sinks need the group's mask"
        mask = group.mask
        bias = _bias(mask) if mask is not None and mask.dtype == torch.bool else mask
        out = _short_attention(qg, keys, values, bias, scale, sinks)
    elif group.max_query_len <= SHORT_QUERY_MAX:
        out = _short_attention(qg, keys, values, group.mask, scale)
    elif group.causal:  # the keys past the chunk's own are the last block's unwritten slots
        n = group.max_query_len
        out = _sdpa(qg, keys[:, :, :n], values[:, :, :n], None, scale, causal=True)
    else:
        out = _sdpa(qg, keys, values, group.mask, scale)
    out = out.reshape(-1, q.shape[1] * q.shape[2])
    return out if group.query_index is None else out[group.query_index]


def _native_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:  # [group_tokens, num_heads * head_dim]
    """Short queries on the CPU: the native kernel reads the pool in place (no gathered copy)."""
    assert group.start_pos is not None and group.query_lens is not None
    out = attention_ops.paged_attention(
        q[group.token_start : group.token_end], k_cache, v_cache, group.block_tables,
        group.start_pos, group.query_lens, scale, window=group.window or 0,
        tree_bits=group.tree_bits,
    )  # fmt: skip
    return out.view(out.shape[0], -1)


def _sdpa(
    q: torch.Tensor,  # [B, Q, heads, dim]
    keys: torch.Tensor,  # [kv_heads, B, L, dim]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # [B, 1, Q, L] bool
    scale: float,
    causal: bool = False,  # Q == L, query i sees keys 0..i
) -> torch.Tensor:  # [B, Q, heads, dim]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=keys.shape[0] != q.shape[2],
    )  # [B, heads, Q, dim]
    return out.transpose(1, 2)


def _short_attention(
    q: torch.Tensor,  # [B, Q, heads, dim]
    keys: torch.Tensor,  # [kv_heads, B, L, dim]
    values: torch.Tensor,
    bias: torch.Tensor | None,  # [B, 1, Q, L] float32
    scale: float,
    sinks: torch.Tensor | None = None,  # [heads]: a zero-valued key's logit per head (gpt-oss)
) -> torch.Tensor:  # [B, Q, heads, dim]
    """Eager attention, the query heads of each KV head stacked as rows: two batched matmuls.

    Scores and probabilities round to the model dtype as in transformers' eager attention;
    the softmax runs in float32. Where the CPU has no native bf16/fp16 matmul (AVX2), the
    matmuls run in float32 (5-10x faster there) and round at the same points, so the result
    does not depend on the host.
    """
    batch, num_q, num_heads, dim = q.shape
    kv_heads = keys.shape[0]
    group = num_heads // kv_heads  # query head h reads KV head h // group
    rows = q.view(batch, num_q, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
    rows = rows.reshape(kv_heads, batch, group * num_q, dim)
    mm = _matmul_dtype(q)
    scores = torch.matmul(rows.to(mm), keys.to(mm).transpose(-1, -2))  # [kvh, B, G*Q, L]
    scores = scores.to(q.dtype).float() * scale
    scores = scores.view(kv_heads, batch, group, num_q, -1)
    if bias is not None:
        scores = scores + bias[None]
    if sinks is not None:  # softmax over the keys and the sink, whose column is then dropped
        sink = sinks.float().view(kv_heads, 1, group, 1, 1).expand(-1, batch, -1, num_q, 1)
        scores = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1].contiguous()
    else:
        scores = scores.softmax(-1)
    probs = scores.to(q.dtype).view(kv_heads, batch, group * num_q, -1)
    out = torch.matmul(probs.to(mm), values.to(mm)).to(q.dtype)  # [kvh, B, G*Q, dim]
    out = out.view(kv_heads, batch, group, num_q, dim).permute(1, 3, 0, 2, 4)
    return out.reshape(batch, num_q, num_heads, dim)


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the attention matmuls run in: x's own, except half precision on a CPU without
    native half-precision dot products, where float32 is the fast one."""
    if x.dtype == torch.float32 or x.device.type != "cpu" or _cpu_has_half_matmul():
        return x.dtype
    return torch.float32


def _cpu_has_half_matmul() -> bool:
    return _CPU_HAS_HALF_MATMUL


def _probe_half_matmul() -> bool:
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private: may go away
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


# Probed once at import: torch.compile cannot trace the probes (engine.model.decode_graph).
_CPU_HAS_HALF_MATMUL = _probe_half_matmul()


def _pad_queries(q: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """[group_tokens, heads, dim] -> [batch, max_query_len, heads, dim]."""
    if group.query_index is None:
        return q.view(group.batch, group.max_query_len, *q.shape[1:])
    padded = q.new_zeros(group.batch * group.max_query_len, *q.shape[1:])
    padded.index_copy_(0, group.query_index, q)
    return padded.view(group.batch, group.max_query_len, *q.shape[1:])


def _context(
    cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, dim]
    group: AttentionGroup,
) -> torch.Tensor:  # [kv_heads, batch, max_blocks * block_size, dim]
    """The group's keys or values: a view of the pool when its one request's blocks are
    consecutive, else a gathered copy."""
    if group.first_block is None:
        return _gather(cache, group.block_tables)
    blocks = group.block_tables.shape[1]
    run = cache[:, group.first_block : group.first_block + blocks]  # [kv_heads, blocks, bs, dim]
    return run.reshape(cache.shape[0], 1, -1, cache.shape[-1])


def _gather(
    cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, dim]
    block_tables: torch.Tensor,  # [batch, max_blocks]
) -> torch.Tensor:  # [kv_heads, batch, max_blocks * block_size, dim], contiguous
    blocks = cache[:, block_tables]  # [kv_heads, batch, max_blocks, block_size, dim]
    return blocks.view(cache.shape[0], block_tables.shape[0], -1, cache.shape[-1])
