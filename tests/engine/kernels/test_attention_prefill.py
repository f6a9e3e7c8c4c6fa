"""On a GPU a prompt chunk with nothing cached before it attends through SDPA's is_causal with no
mask (flash-eligible), with GQA, and gives what the masked path gave: checked here by taking that
path on a CPU (`causal_prefill`). A CPU itself keeps the masked call."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model import attention
from engine.model.attention import AttentionMetadata, RequestSpan, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


@pytest.fixture
def gpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "causal_prefill", lambda device: True)


def _pool(num_blocks: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (KV_HEADS, num_blocks, BLOCK, DIM)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _qkv(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(n, h, DIM, generator=gen).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS)
    )


def _masked(meta: AttentionMetadata, spans: list[RequestSpan]) -> AttentionMetadata:
    """The same metadata with the mask the long group carried before the causal path."""
    groups = []
    for group, span in zip(meta.groups, spans, strict=True):
        kv_len = group.block_tables.shape[1] * BLOCK
        mask = attention._mask([span], group.max_query_len, kv_len, always=False)
        groups.append(dataclasses.replace(group, mask=mask, causal=False))
    return dataclasses.replace(meta, groups=tuple(groups))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompt_chunk_is_causal_and_equals_the_masked_path(
    gpu_path: None, dtype: torch.dtype
) -> None:
    n = 37  # not a multiple of the block size: the last block has unwritten slots
    spans = [RequestSpan(0, n, list(range(10)))]
    meta = AttentionMetadata.build(spans, BLOCK, torch.device("cpu"))
    (group,) = meta.groups
    assert group.causal and group.mask is None
    q, k, v = _qkv(n, dtype, seed=0)
    scale = DIM**-0.5
    got = paged_attention(q, k, v, *_pool(10, dtype), meta, scale)
    want = paged_attention(q, k, v, *_pool(10, dtype), _masked(meta, spans), scale)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


def test_fresh_prompt_matches_plain_causal_attention(gpu_path: None) -> None:
    n = 21
    meta = AttentionMetadata.build([RequestSpan(0, n, list(range(6)))], BLOCK, torch.device("cpu"))
    q, k, v = _qkv(n, torch.float32, seed=1)
    got = paged_attention(q, k, v, *_pool(6, torch.float32), meta, 0.25)
    group = HEADS // KV_HEADS
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.25  # [heads, n, n]
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, -1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunks_behind_a_cached_prefix_keep_their_mask(gpu_path: None) -> None:
    spans = [RequestSpan(8, 20, list(range(8))), RequestSpan(0, 3, [8, 9])]
    meta = AttentionMetadata.build(spans, BLOCK, torch.device("cpu"))
    long, short = meta.groups
    assert not long.causal and long.mask is not None
    assert not short.causal


def test_a_cpu_keeps_the_masked_prefill() -> None:
    meta = AttentionMetadata.build([RequestSpan(0, 30, list(range(8)))], BLOCK, torch.device("cpu"))
    assert not meta.groups[0].causal and meta.groups[0].mask is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consecutive_blocks_are_read_in_place_and_equal_the_gathered_copy(
    dtype: torch.dtype,
) -> None:
    """A long chunk behind a cached prefix whose blocks are one run of the pool attends to a view
    of it; a run out of order gathers. Both give the same values, bit for bit."""
    n, start = 23, 9
    run = [RequestSpan(start, n, [3, 4, 5, 6, 7, 8, 9, 10])]
    scattered = [RequestSpan(start, n, [3, 4, 6, 5, 7, 8, 9, 10])]
    in_place = AttentionMetadata.build(run, BLOCK, torch.device("cpu"))
    assert in_place.groups[0].first_block == 3
    assert (
        AttentionMetadata.build(scattered, BLOCK, torch.device("cpu")).groups[0].first_block is None
    )
    gathered = dataclasses.replace(
        in_place, groups=tuple(dataclasses.replace(g, first_block=None) for g in in_place.groups)
    )
    q, k, v = _qkv(n, dtype, seed=3)
    pool = _pool(12, dtype)
    pool[0].normal_(generator=torch.Generator().manual_seed(4))  # the cached prefix
    pool[1].normal_(generator=torch.Generator().manual_seed(5))
    got = paged_attention(q, k, v, pool[0].clone(), pool[1].clone(), in_place, DIM**-0.5)
    want = paged_attention(q, k, v, pool[0].clone(), pool[1].clone(), gathered, DIM**-0.5)
    assert torch.equal(got, want)


def test_short_and_batched_groups_never_take_the_view() -> None:
    spans = [RequestSpan(0, 3, [0]), RequestSpan(0, 5, [1, 2])]
    meta = AttentionMetadata.build(spans, BLOCK, torch.device("cpu"))
    assert all(group.first_block is None for group in meta.groups)
