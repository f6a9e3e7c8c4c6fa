"""The native paged attention kernel against the gathered attention it replaces, and the engine on it."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_greedy, hf_model, make_engine, outputs, random_prompts

from engine.config import SpeculativeConfig
from engine.kernels import attention_ops
from engine.model import attention
from engine.model.attention import AttentionMetadata, RequestSpan

pytestmark = pytest.mark.skipif(
    not attention_ops.loaded(), reason="native kernels not built on this host"
)
engine_path = pytest.mark.skipif(
    not attention_ops.available(), reason="the engine uses the kernel only with AVX512"
)
_VARIANTS = (("avx2", "avx2"), ("avx512", "avx512"))  # (isa argument, CPU tier)
ISAS = ["scalar"] + [
    isa
    for isa, flag in _VARIANTS
    if attention_ops.loaded() and torch.ops.specserve_kernels.cpu_supports(flag)
]


# bfloat16 caches also have the AVX512-BF16 kernel (scores through `vdpbf16ps`) and, with blocks
# of 16, the AMX one (scores through `tdpbf16ps`)
BF16_ISAS = ISAS + [
    isa
    for isa, flag in (("avx512bf16", "avx512bf16"), ("amx", "amxbf16"))
    if attention_ops.loaded() and torch.ops.specserve_kernels.cpu_supports(flag)
]


def _pool(kv_heads: int, blocks: int, block_size: int, dim: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (kv_heads, blocks, block_size, dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _spans(batch: int, block_size: int, blocks: int, max_ctx: int, seed: int) -> list[RequestSpan]:
    """Ragged requests over one pool: random context lengths and query lengths (1-16), random
    block ids, and the first two requests sharing their prefix blocks (a prefix-cache hit)."""
    rng = random.Random(seed)
    ids = list(range(blocks))
    rng.shuffle(ids)
    shared = ids[:3]
    spans = []
    for b in range(batch):
        num_tokens = rng.choice([1, 1, 2, 5, 16])
        context = rng.randint(num_tokens, max_ctx)
        need = -(-context // block_size)
        own = (
            ids[3 + b * need : 3 + (b + 1) * need] if b >= 2 else shared + ids[50 + 20 * b :][:need]
        )
        spans.append(RequestSpan(context - num_tokens, num_tokens, own[:need]))
    return spans


def _both(q, k_cache, v_cache, spans, block_size, **kernel_kw):  # type: ignore[no-untyped-def]
    meta = AttentionMetadata.build(spans, block_size, torch.device("cpu"))
    (group,) = meta.groups
    scale = q.shape[-1] ** -0.5
    qg = attention._pad_queries(q, group)
    keys = attention._gather(k_cache, group.block_tables)
    values = attention._gather(v_cache, group.block_tables)
    ref = attention._short_attention(qg, keys, values, group.mask, scale)
    ref = ref.reshape(-1, q.shape[1], q.shape[2])
    ref = ref if group.query_index is None else ref[group.query_index]
    out = attention_ops.paged_attention(
        q, k_cache, v_cache, group.block_tables, group.start_pos, group.query_lens, scale,
        **kernel_kw,
    )  # fmt: skip
    return out, ref


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ratio", [1, 2, 6, 7])
@pytest.mark.parametrize("split_tokens", [8, 256])
def test_kernel_matches_gathered_attention_float32(isa: str, ratio: int, split_tokens: int) -> None:
    block_size, kv_heads, dim = 4, 2, 32
    k_cache, v_cache = _pool(kv_heads, 400, block_size, dim, torch.float32, seed=ratio)
    spans = _spans(6, block_size, 400, max_ctx=150, seed=ratio + 10)
    tokens = sum(s.num_tokens for s in spans)
    q = torch.randn(tokens, kv_heads * ratio, dim)
    out, ref = _both(q, k_cache, v_cache, spans, block_size, isa=isa, split_tokens=split_tokens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_one_long_request_split_over_ranges(isa: str) -> None:
    """Context lengths that are not multiples of the block size, one request, many ranges."""
    block_size, dim = 16, 128
    k_cache, v_cache = _pool(2, 300, block_size, dim, torch.float32, seed=3)
    for context, num_tokens in [(2693, 1), (1000, 16), (17, 3), (1, 1)]:
        table = list(range(299, 299 - (-(-context // block_size)), -1))
        spans = [RequestSpan(context - num_tokens, num_tokens, table)]
        q = torch.randn(num_tokens, 12, dim)
        out, ref = _both(q, k_cache, v_cache, spans, block_size, isa=isa, split_tokens=64)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", BF16_ISAS)
@pytest.mark.parametrize("ratio", [1, 2, 6, 7])
def test_kernel_bfloat16_close_to_gathered(isa: str, ratio: int) -> None:
    """bfloat16: the same score rounding; probabilities stay float32, so only output-rounding
    differences remain (an ulp or two of bfloat16). GQA ratios 1-7: 2 to 14 query heads, so
    a verify of 16 tokens is up to 112 rows of an item."""
    block_size, dim = 16, 64
    k_cache, v_cache = _pool(2, 200, block_size, dim, torch.bfloat16, seed=5)
    spans = _spans(5, block_size, 200, max_ctx=300, seed=6)
    q = torch.randn(sum(s.num_tokens for s in spans), 2 * ratio, dim).to(torch.bfloat16)
    out, ref = _both(q, k_cache, v_cache, spans, block_size, isa=isa, split_tokens=32)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("isa", ISAS)
def test_a_request_is_computed_the_same_in_any_batch(isa: str) -> None:
    """Bitwise: a request alone equals itself in a batch, and each row of a verify query equals
    the one-token decode of that position (the ranges depend on the request alone)."""
    block_size, dim = 4, 32
    k_cache, v_cache = _pool(2, 300, block_size, dim, torch.float32, seed=8)
    spans = _spans(5, block_size, 300, max_ctx=120, seed=9)
    tokens = sum(s.num_tokens for s in spans)
    q = torch.randn(tokens, 12, dim)
    batched, _ = _both(q, k_cache, v_cache, spans, block_size, isa=isa, split_tokens=8)
    offset = 0
    for span in spans:
        rows = slice(offset, offset + span.num_tokens)
        alone, _ = _both(q[rows], k_cache, v_cache, [span], block_size, isa=isa, split_tokens=8)
        assert torch.equal(alone, batched[rows])
        for j in range(span.num_tokens):
            decode = RequestSpan(span.start_pos + j, 1, span.block_table)
            one, _ = _both(q[offset + j : offset + j + 1], k_cache, v_cache, [decode], block_size,
                           isa=isa, split_tokens=8)  # fmt: skip
            assert torch.equal(one[0], batched[offset + j])
        offset += span.num_tokens


def _kernel(q, k_cache, v_cache, spans, block_size, isa):  # type: ignore[no-untyped-def]
    """The kernel over any mix of query lengths, one block table per request."""
    width = max(len(s.block_table) for s in spans)
    tables = torch.tensor([list(s.block_table) + [0] * (width - len(s.block_table)) for s in spans])
    starts = torch.tensor([s.start_pos for s in spans])
    lens = torch.tensor([s.num_tokens for s in spans])
    return attention_ops.paged_attention(
        q, k_cache, v_cache, tables, starts, lens, q.shape[-1] ** -0.5, isa=isa, split_tokens=32
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", BF16_ISAS)
def test_prompt_chunks_match_gathered_attention(isa: str, dtype: torch.dtype) -> None:
    """Prompt chunks (many query tiles, a prefix cached or not, GQA 6) against the padded
    attention they replace."""
    if isa in ("avx512bf16", "amx") and dtype == torch.float32:
        pytest.skip("the bf16 and AMX kernels read bfloat16 caches only")
    block_size, dim = 16, 128
    k_cache, v_cache = _pool(2, 120, block_size, dim, dtype, seed=11)
    for start, num_tokens in [(0, 40), (37, 70), (300, 17), (0, 200)]:
        blocks = -(-(start + num_tokens) // block_size)
        span = RequestSpan(start, num_tokens, list(range(119, 119 - blocks, -1)))
        q = torch.randn(num_tokens, 12, dim).to(dtype)
        meta = AttentionMetadata.build([span], block_size, torch.device("cpu"))
        (group,) = meta.groups
        mask = attention._bias(attention._mask([span], num_tokens, blocks * block_size, True))
        keys = attention._gather(k_cache, group.block_tables)
        values = attention._gather(v_cache, group.block_tables)
        ref = attention._short_attention(q[None], keys, values, mask, dim**-0.5)[0]
        out = _kernel(q, k_cache, v_cache, [span], block_size, isa)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", BF16_ISAS)
def test_a_row_is_the_same_in_a_prompt_chunk_a_verify_and_a_decode(
    isa: str, dtype: torch.dtype
) -> None:
    """Bitwise: each row of a long prompt chunk (batched with decodes) equals the one-token
    decode of its position and the same row inside a short verify query, so speculation that
    puts drafts behind a prompt, or a chunking that differs, changes no output."""
    if isa in ("avx512bf16", "amx") and dtype == torch.float32:
        pytest.skip("the bf16 and AMX kernels read bfloat16 caches only")
    block_size, dim = 16, 64
    k_cache, v_cache = _pool(2, 200, block_size, dim, dtype, seed=12)
    chunk = RequestSpan(45, 60, list(range(20, 27)))
    other = RequestSpan(80, 1, list(range(100, 106)))
    q = torch.randn(61, 12, dim).to(dtype)
    batched = _kernel(q, k_cache, v_cache, [other, chunk], block_size, isa)
    for j in (0, 15, 16, 17, 33, 57):
        decode = RequestSpan(45 + j, 1, chunk.block_table)
        one = _kernel(q[1 + j : 2 + j], k_cache, v_cache, [decode], block_size, isa)
        assert torch.equal(one[0], batched[1 + j]), j
        verify = RequestSpan(45 + j, 3, chunk.block_table)
        three = _kernel(q[1 + j : 4 + j], k_cache, v_cache, [verify], block_size, isa)
        assert torch.equal(three[0], batched[1 + j]), j


def test_kernel_rejects_what_it_cannot_read() -> None:
    k_cache, v_cache = _pool(2, 4, 4, 16, torch.float32, seed=0)
    tables = torch.tensor([[0, 1]])
    one = torch.tensor([1])
    with pytest.raises(RuntimeError, match="bad request"):  # context beyond its block table
        attention_ops.paged_attention(
            torch.randn(1, 2, 16), k_cache, v_cache, tables, torch.tensor([8]), one, 1.0
        )
    with pytest.raises(RuntimeError, match="out of range"):
        attention_ops.paged_attention(
            torch.randn(1, 2, 16),
            k_cache,
            v_cache,
            torch.tensor([[9]]),
            torch.tensor([0]),
            one,
            1.0,
        )


# ---------------------------------------------------------------------------- the engine on it


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the tokens that went through the native kernel."""
    calls: list[int] = []
    kernel = attention_ops.paged_attention

    def counted(q: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return kernel(q, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_ops, "paged_attention", counted)
    yield calls


@engine_path
def test_engine_greedy_unchanged_on_the_kernel(
    tiny_model_dir: Path, native_calls: list[int]
) -> None:
    vocab = hf_model(tiny_model_dir).config.vocab_size
    # chunked prefill: prompt chunks share steps with decodes (a mixed batch)
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=24)
    prompts = random_prompts(6, (2, 60), vocab, seed=21)
    got = outputs(engine, prompts, greedy(8))
    assert got == [hf_greedy(tiny_model_dir, p, 8) for p in prompts]
    assert native_calls


@engine_path
def test_speculative_greedy_equals_plain_on_the_kernel(
    tiny_model_dir: Path, native_calls: list[int]
) -> None:
    vocab = hf_model(tiny_model_dir).config.vocab_size
    prompts = [p * 3 for p in random_prompts(4, (4, 10), vocab, seed=22)]  # n-grams to find
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    plain = outputs(make_engine(tiny_model_dir), prompts, greedy(12))
    spec_out = outputs(make_engine(tiny_model_dir, speculative=spec), prompts, greedy(12))
    assert spec_out == plain
    assert max(native_calls) > len(prompts)  # verify queries of several tokens went through it


@engine_path
def test_preemption_and_prefix_cache_on_the_kernel(
    tiny_model_dir: Path, native_calls: list[int]
) -> None:
    vocab = hf_model(tiny_model_dir).config.vocab_size
    shared = random_prompts(1, (33, 33), vocab, seed=23)[0]
    prompts = [shared + [5 + i] for i in range(4)]
    engine = make_engine(tiny_model_dir, num_kv_blocks=24)
    preemptions = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, greedy(16))
    results: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        preemptions += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert preemptions > 0 and engine.block_manager.num_hit_tokens >= 32
    assert [results[f"p{i}"] for i in range(4)] == [
        hf_greedy(tiny_model_dir, p, 16) for p in prompts
    ]
    assert native_calls


def test_switched_off_the_engine_keeps_the_gathered_path(
    tiny_model_dir: Path, native_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_NATIVE_ATTENTION", "0")
    attention_ops.available.cache_clear()
    try:
        vocab = hf_model(tiny_model_dir).config.vocab_size
        prompts = random_prompts(3, (2, 30), vocab, seed=24)
        got = outputs(make_engine(tiny_model_dir), prompts, greedy(6))
        assert got == [hf_greedy(tiny_model_dir, p, 6) for p in prompts]
        assert not native_calls
    finally:
        monkeypatch.undo()
        attention_ops.available.cache_clear()


@engine_path
def test_speculative_greedy_equals_plain_in_bfloat16_with_head_dim_64(
    tmp_path: Path, native_calls: list[int]
) -> None:
    """bfloat16, head_dim 64, blocks of 16: the caches the AVX512-BF16 and AMX kernels take (the
    AMX one where the CPU has it). Verify rows must equal the decodes of their positions, so
    n-gram speculation returns plain decoding's tokens exactly."""
    from tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "bf16", hidden_size=256, num_heads=4, num_kv_heads=2,
                                intermediate_size=256, seed=3)  # fmt: skip
    vocab = hf_model(model_dir).config.vocab_size
    prompts = [p * 4 for p in random_prompts(4, (5, 12), vocab, seed=25)]  # n-grams to find
    kw = dict(dtype="bfloat16", block_size=16, num_kv_blocks=64)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    plain = outputs(make_engine(model_dir, **kw), prompts, greedy(24))
    spec_out = outputs(make_engine(model_dir, speculative=spec, **kw), prompts, greedy(24))
    assert spec_out == plain
    assert max(native_calls) > len(prompts)  # verify queries of several tokens went through it
