"""The native paged attention kernel with a sliding window (Gemma 3's local layers): every
variant against a dense masked reference in float64, against the scalar reference, against the
gathered windowed path it replaces, and bitwise the same row in any query or batch."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kernels import attention_ops
from engine.model import attention
from engine.model.attention import AttentionMetadata, RequestSpan

pytestmark = pytest.mark.skipif(
    not attention_ops.loaded(), reason="native kernels not built on this host"
)


def _supported(flag: str) -> bool:
    return attention_ops.loaded() and bool(torch.ops.specserve_kernels.cpu_supports(flag))


ISAS = ["scalar"] + [isa for isa in ("avx2", "avx512") if _supported(isa)]
# bfloat16 caches also have the AVX512-BF16 kernel and, with blocks of 16, the AMX one
BF16_ISAS = ISAS + [isa for isa, flag in (("avx512bf16", "avx512bf16"), ("amx", "amxbf16"))
                    if _supported(flag)]  # fmt: skip


def _pool(kv_heads: int, blocks: int, block_size: int, dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (kv_heads, blocks, block_size, dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _spans(batch: int, block_size: int, blocks: int, max_ctx: int, seed: int) -> list[RequestSpan]:
    """Ragged requests with shuffled block ids: decodes, verify queries and a prompt chunk."""
    rng = random.Random(seed)
    ids = list(range(blocks))
    rng.shuffle(ids)
    spans, used = [], 0
    for _ in range(batch):
        num_tokens = rng.choice([1, 1, 3, 7, 16])
        context = rng.randint(num_tokens, max_ctx)
        need = -(-context // block_size)
        spans.append(RequestSpan(context - num_tokens, num_tokens, ids[used : used + need]))
        used += need
    return spans


def _tables(spans: list[RequestSpan], block_size: int, window: int) -> torch.Tensor:
    """Each request's table from the first block its first query's window reaches."""
    rows = [list(s.block_table[max(0, s.start_pos + 1 - window) // block_size :]) for s in spans]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64)


def _kernel(q, k_cache, v_cache, spans, block_size, window, isa, split_tokens=32):  # type: ignore[no-untyped-def]
    starts = torch.tensor([s.start_pos for s in spans])
    lens = torch.tensor([s.num_tokens for s in spans])
    tables = _tables(spans, block_size, window)
    return attention_ops.paged_attention(
        q, k_cache, v_cache, tables, starts, lens, q.shape[-1] ** -0.5, isa=isa,
        split_tokens=split_tokens, window=window,
    )  # fmt: skip


def _dense(q, k_cache, v_cache, spans, block_size, window):  # type: ignore[no-untyped-def]
    """softmax(q k^T * scale) v per request in float64, keys (p - window, p] of query p."""
    kv_heads, dim = k_cache.shape[0], k_cache.shape[-1]
    group = q.shape[1] // kv_heads
    outs, offset = [], 0
    for s in spans:
        slots = [s.block_table[p // block_size] * block_size + p % block_size
                 for p in range(s.context_len)]  # fmt: skip
        keys = k_cache.reshape(kv_heads, -1, dim)[:, slots].double()  # [kv_heads, ctx, dim]
        values = v_cache.reshape(kv_heads, -1, dim)[:, slots].double()
        qs = q[offset : offset + s.num_tokens].double()  # [n, heads, dim]
        scores = torch.einsum("nhd,hkd->hnk", qs, keys.repeat_interleave(group, 0)) * dim**-0.5
        pos = torch.arange(s.start_pos, s.context_len)[:, None]  # [n, 1]
        key = torch.arange(s.context_len)[None, :]
        seen = (key <= pos) & (key > pos - window)
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hnk,hkd->nhd", probs, values.repeat_interleave(group, 0)))
        offset += s.num_tokens
    return torch.cat(outs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("ratio", [1, 3])
def test_window_matches_the_dense_reference_float32(isa: str, window: int, ratio: int) -> None:
    """Windows shorter than a block, a block's multiple, neither, and wider than most contexts;
    ranges of 8 tokens (many before each window) and of 32."""
    block_size, kv_heads, dim = 4, 2, 32
    k_cache, v_cache = _pool(kv_heads, 500, block_size, dim, torch.float32, seed=window)
    spans = _spans(6, block_size, 500, max_ctx=180, seed=window + ratio)
    q = torch.randn(sum(s.num_tokens for s in spans), kv_heads * ratio, dim)
    ref = _dense(q, k_cache, v_cache, spans, block_size, window).float()
    for split in (8, 32):
        out = _kernel(q, k_cache, v_cache, spans, block_size, window, isa, split)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("window", [16, 40, 512])
def test_window_bfloat16_head_dim_256(isa: str, window: int) -> None:
    """Gemma 3 270M's attention: head_dim 256, one KV head for four query heads, blocks of 16,
    bfloat16 caches (every bf16 variant), contexts past the window; close to the dense float64
    reference within bfloat16's rounding, and to the scalar reference within a few ulps."""
    block_size, dim = 16, 256
    k_cache, v_cache = _pool(1, 200, block_size, dim, torch.bfloat16, seed=window)
    spans = _spans(5, block_size, 200, max_ctx=600, seed=window)
    q = torch.randn(sum(s.num_tokens for s in spans), 4, dim).to(torch.bfloat16)
    out = _kernel(q, k_cache, v_cache, spans, block_size, window, isa, 256)
    ref = _dense(q, k_cache, v_cache, spans, block_size, window).float()
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    scalar = _kernel(q, k_cache, v_cache, spans, block_size, window, "scalar", 256)
    torch.testing.assert_close(out.float(), scalar.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
def test_window_matches_the_gathered_windowed_path(isa: str) -> None:
    """What the engine's local layers computed before: the gathered copy from the window's first
    block and the windowed bias, through the eager short attention (metadata's `sliding`)."""
    block_size, dim, window = 4, 64, 23
    k_cache, v_cache = _pool(2, 400, block_size, dim, torch.float32, seed=1)
    spans = _spans(6, block_size, 400, max_ctx=150, seed=2)
    q = torch.randn(sum(s.num_tokens for s in spans), 4, dim)
    meta = AttentionMetadata.build(spans, block_size, torch.device("cpu"), sliding_window=window)
    assert meta.sliding is not None
    (group,) = meta.sliding.groups
    assert group.window == window and group.start_pos is not None
    qg = attention._pad_queries(q, group)
    keys = attention._gather(k_cache, group.block_tables)
    values = attention._gather(v_cache, group.block_tables)
    ref = attention._short_attention(qg, keys, values, group.mask, dim**-0.5)
    ref = ref.reshape(-1, 4, dim)
    ref = ref if group.query_index is None else ref[group.query_index]
    out = attention_ops.paged_attention(
        q, k_cache, v_cache, group.block_tables, group.start_pos, group.query_lens, dim**-0.5,
        isa=isa, split_tokens=16, window=window,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(attention._native_attention(q, k_cache, v_cache, group, dim**-0.5),
                       attention_ops.paged_attention(
                           q, k_cache, v_cache, group.block_tables, group.start_pos,
                           group.query_lens, dim**-0.5, window=window).view(q.shape[0], -1))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", BF16_ISAS)
def test_a_windowed_row_is_the_same_in_any_query_and_batch(isa: str, dtype: torch.dtype) -> None:
    """Bitwise: each row of a prompt chunk or a verify query (batched with other requests) equals
    the one-token decode of its position, though their items start at different blocks and
    ranges (the verify's first query's window reaches blocks the decode's does not)."""
    if isa in ("avx512bf16", "amx") and dtype == torch.float32:
        pytest.skip("the bf16 and AMX kernels read bfloat16 caches only")
    block_size, dim, window = 16, 64, 40
    k_cache, v_cache = _pool(2, 200, block_size, dim, dtype, seed=12)
    chunk = RequestSpan(45, 60, list(range(20, 27)))
    other = RequestSpan(80, 1, list(range(100, 106)))
    q = torch.randn(61, 12, dim).to(dtype)
    batched = _kernel(q, k_cache, v_cache, [other, chunk], block_size, window, isa)
    for j in (0, 1, 15, 16, 17, 33, 38, 57, 59):
        decode = RequestSpan(45 + j, 1, chunk.block_table)
        one = _kernel(q[1 + j : 2 + j], k_cache, v_cache, [decode], block_size, window, isa)
        assert torch.equal(one[0], batched[1 + j]), j
        for n in (2, 5):
            if j + n <= 60:
                verify = RequestSpan(45 + j, n, chunk.block_table)
                rows = _kernel(q[1 + j : 1 + j + n], k_cache, v_cache, [verify], block_size,
                               window, isa)  # fmt: skip
                assert torch.equal(rows, batched[1 + j : 1 + j + n]), (j, n)


@pytest.mark.parametrize("isa", [isa for isa in BF16_ISAS if isa != "scalar"])
def test_every_variant_equals_the_scalar_reference_closely(isa: str) -> None:
    """Float32 caches through each SIMD variant (bfloat16 ones for the bf16 kernels) against the
    portable reference, with a window, over many blocks and ranges."""
    dtype = torch.bfloat16 if isa in ("avx512bf16", "amx") else torch.float32
    block_size, dim, window = 16, 128, 70
    k_cache, v_cache = _pool(2, 300, block_size, dim, dtype, seed=4)
    spans = _spans(8, block_size, 300, max_ctx=500, seed=5)
    q = torch.randn(sum(s.num_tokens for s in spans), 8, dim).to(dtype)
    out = _kernel(q, k_cache, v_cache, spans, block_size, window, isa, 64)
    ref = _kernel(q, k_cache, v_cache, spans, block_size, window, "scalar", 64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_a_window_needs_only_the_blocks_it_reaches() -> None:
    """A decode at position 1000 with a window of 32 reads from its table's start, which is
    block (1000 + 1 - 32) // 16 = 60 of its context: a table of the remaining 3 blocks suffices,
    and a negative window is refused."""
    k_cache, v_cache = _pool(1, 8, 16, 64, torch.float32, seed=0)
    q = torch.randn(1, 2, 64)
    tables = torch.tensor([[5, 6, 7]])
    start, one = torch.tensor([1000]), torch.tensor([1])
    out = attention_ops.paged_attention(q, k_cache, v_cache, tables, start, one, 0.1, window=32)
    assert out.isfinite().all()
    with pytest.raises(RuntimeError, match="bad request"):  # without the window: 63 blocks short
        attention_ops.paged_attention(q, k_cache, v_cache, tables, start, one, 0.1)
    with pytest.raises(RuntimeError, match="window"):
        attention_ops.paged_attention(q, k_cache, v_cache, tables, start, one, 0.1, window=-1)
