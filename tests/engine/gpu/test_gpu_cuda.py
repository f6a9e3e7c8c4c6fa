"""The CUDA path on a real GPU (marked `gpu`, skipped without one; scripts/gpu_check.sh runs them
first): logits against transformers, greedy tokens against the CPU for none / n-gram / draft
speculation, speculation equal to plain decoding in bf16, the step's host reads, the KV pool's
size, event timings, dense weights for the CPU-only settings, the flash kernel on a prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_model, make_engine, outputs, random_prompts
from test_host_syncs import MAX_READS_PER_STEP, VOCAB, _reads_per_decode_step

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model.attention import AttentionMetadata, RequestSpan, paged_attention
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
MAX_TOKENS = 12


def _spec(method: str, draft: Path, k: int = 3) -> SpeculativeConfig:
    if method == "none":
        return SpeculativeConfig()
    if method == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False)
    return SpeculativeConfig(
        method="draft", num_speculative_tokens=k, draft_model=str(draft), adaptive=False
    )


def _engine(model: Path, draft: Path, method: str, device: str, dtype: str) -> LLMEngine:
    return make_engine(model, speculative=_spec(method, draft), device=device, dtype=dtype)


def _prompts() -> list[list[int]]:
    base = random_prompts(4, (4, 24), VOCAB, seed=5)
    return [p * 2 for p in base]  # repeats, so n-gram lookup finds matches


def test_logits_match_transformers_on_cuda(tiny_model_dir: Path) -> None:
    ids = random_prompts(1, (20, 20), VOCAB, seed=3)[0]
    runner = ModelRunner(load_model(str(tiny_model_dir)), "cuda", "float32", 4)
    runner.allocate_kv_cache(16)
    got = runner.forward([ForwardInput(ids, 0, list(range(5)), len(ids))]).cpu()
    hf = hf_model(tiny_model_dir).to("cuda")
    try:
        with torch.no_grad():
            want = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    finally:
        hf.to("cpu")
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_greedy_tokens_on_cuda_equal_the_cpu(
    tiny_model_dir: Path, tiny_draft_dir: Path, method: str
) -> None:
    prompts = _prompts()
    cpu = outputs(
        _engine(tiny_model_dir, tiny_draft_dir, method, "cpu", "float32"),
        prompts,
        greedy(MAX_TOKENS),
    )
    cuda_engine = _engine(tiny_model_dir, tiny_draft_dir, method, "cuda", "float32")
    assert outputs(cuda_engine, prompts, greedy(MAX_TOKENS)) == cpu


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_bf16_speculation_equals_plain_on_cuda(
    tiny_model_dir: Path, tiny_draft_dir: Path, method: str
) -> None:
    prompts = _prompts()
    plain = _engine(tiny_model_dir, tiny_draft_dir, "none", "cuda", "bfloat16")
    spec = _engine(tiny_model_dir, tiny_draft_dir, method, "cuda", "bfloat16")
    seqs = spec.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert sum(s.spec.num_draft_tokens for s in seqs) > 0


def test_host_reads_per_step_on_cuda(tiny_model_dir: Path, tiny_draft_dir: Path) -> None:
    engine = _engine(tiny_model_dir, tiny_draft_dir, "draft", "cuda", "float32")
    assert max(_reads_per_decode_step(engine, 4)) <= MAX_READS_PER_STEP


def test_kv_pool_honours_kv_cache_gib_on_cuda(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, device="cuda:0", num_kv_blocks=None, kv_cache_gib=0.001)
    used = engine.block_manager.num_blocks * engine.target.kv_bytes_per_block
    assert 0 < used <= 0.001 * (1 << 30)


def test_forward_timings_are_device_time(tiny_model_dir: Path) -> None:
    runner = ModelRunner(load_model(str(tiny_model_dir)), "cuda", "float32", 4)
    runner.allocate_kv_cache(8)
    runner.timings = []
    runner.forward([ForwardInput([5, 6, 7], 0, [0], 1)])
    ((rows, seconds),) = runner.take_timings()
    assert rows == 3 and 0 < seconds < 1


@pytest.mark.parametrize("quantization", ["w8a8", "auto", "int8"])
def test_cpu_only_quantization_loads_dense_on_cuda(tiny_model_dir: Path, quantization: str) -> None:
    engine = make_engine(tiny_model_dir, device="cuda", dtype="bfloat16", quantization=quantization)
    assert engine.target.weights.label == "bf16"


def test_fresh_prefill_runs_on_the_flash_kernel() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, heads, kv_heads, dim, block = 300, 12, 2, 128, 16
    meta = AttentionMetadata.build(
        [RequestSpan(0, n, list(range(19)))], block, torch.device("cuda")
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(n, h, dim, generator=gen).to("cuda", torch.bfloat16)
        for h in (heads, kv_heads, kv_heads)
    )
    pool = [
        torch.zeros(kv_heads, 19, block, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    ]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = paged_attention(q, k, v, *pool, meta, dim**-0.5)
    with sdpa_kernel(SDPBackend.MATH):
        math = paged_attention(q, k, v, *pool, meta, dim**-0.5)
    torch.testing.assert_close(flash, math, atol=2e-2, rtol=2e-2)
