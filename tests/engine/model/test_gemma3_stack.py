"""Gemma 3 on the native fast path: its ops (engine/kernels/gemma_ops.py, csrc/gemma.cpp) against
transformers' in every ISA variant, and its layers in the native stack (csrc/layers.cpp: q/k norms,
offset and sandwich norms, GeGLU, the local layers' rope and window) bit for bit the Python loop's
on a Q8_0 Gemma 3 GGUF, for decodes, verify queries and batches past the window, and in the
engine with and without speculation."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_utils import greedy, make_engine, outputs, random_prompts
from gguf import GGMLQuantizationType as T
from gguf_blocks import write_gemma3_gguf
from stack_utils import stack_and_loop_agree
from tiny import make_tiny_model

from engine.config import SpeculativeConfig
from engine.kernels import gemma_ops, gguf_ops
from engine.model import decoder_stack
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

pytestmark = pytest.mark.skipif(
    not (gguf_ops.available() and gemma_ops.loaded()), reason="native kernels not built"
)
WINDOW = 8
GEMMA3 = dict(
    family="gemma3",
    num_layers=4,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=WINDOW,
    query_pre_attn_scalar=16,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
    },
)
ISAS = ["scalar"] + [
    isa
    for isa in ("avx2", "avx512")
    if gemma_ops.loaded() and torch.ops.specserve_kernels.cpu_supports(isa)
]


# ---- the ops against transformers' ------------------------------------------------------------


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rmsnorm_matches_gemma3_rmsnorm(isa: str, dtype: torch.dtype) -> None:
    """transformers' Gemma3RMSNorm of (x rounded) + residual: float32 within float32's rounding,
    bfloat16 within an ulp; the sum bit for bit; every variant equal to the scalar one."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 640, generator=g) * 3  # float32 as a GEMM leaves it
    residual = torch.randn(7, 640, generator=g).to(dtype)
    norm = Gemma3RMSNorm(640, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(640, generator=g) * 0.5)
    weight = norm.weight.detach().to(dtype)
    total = x.to(dtype) + residual
    want = norm.to(dtype)(total).float()
    out, got_total = gemma_ops.offset_rmsnorm(x, residual, weight, 1e-6, dtype, torch.float32, isa)
    assert torch.equal(got_total, total)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    scalar = gemma_ops.offset_rmsnorm(x, residual, weight, 1e-6, dtype, torch.float32, "scalar")
    assert torch.equal(out, scalar[0])
    alone, _ = gemma_ops.offset_rmsnorm(x.to(dtype)[3:4], None, weight, 1e-6, dtype, dtype, isa)
    torch.testing.assert_close(alone.float(), norm.to(dtype)(x.to(dtype)[3:4]).float(),
                               rtol=tol, atol=tol)  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_transformers_geglu(isa: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(5, 2 * 2048, generator=g) * 4
    gate, up = gate_up.to(dtype).chunk(2, dim=-1)
    want = (F.gelu(gate, approximate="tanh") * up).float()
    got = gemma_ops.gelu_tanh_mul(gate_up, dtype, torch.float32, isa)
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got, gemma_ops.gelu_tanh_mul(gate_up, dtype, torch.float32, "scalar"))


# ---- the stack against the Python loop --------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gemma3-stack")
    src = make_tiny_model(tmp / "src", seed=3, **GEMMA3)  # type: ignore[arg-type]
    path = tmp / "gemma3-q8.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE", str(tmp / "cache"))
        write_gemma3_gguf(path, src, T.Q8_0)
    return path


def _runner(path: Path, dtype: str) -> ModelRunner:
    runner = ModelRunner(load_model(str(path), "gguf"), "cpu", dtype, 4)  # type: ignore[arg-type]
    runner.allocate_kv_cache(64)
    return runner


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_python_loop_past_the_window(
    gemma_gguf: Path, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="specserve.engine"):
        runner = _runner(gemma_gguf, dtype)
    assert runner.model.native_stack is not None
    assert any("4 layers in one native call" in r.getMessage() for r in caplog.records)
    prompt = random_prompts(1, (30, 30), 300, seed=4)[0]
    table = list(range(20, 0, -1))
    runner.forward([ForwardInput(prompt, 0, table, 1)])  # a prompt chunk: the Python loop
    cases = [
        [ForwardInput([7], 30, table, 1)],  # a decode whose window starts mid-block
        [ForwardInput([7, 8, 9, 10, 11], 30, table, 5)],  # a verify query
        [  # a batch: a decode, a verify inside the window, one at a block boundary
            ForwardInput([7], 30, table, 1),
            ForwardInput([5, 6, 7], 5, [40, 41], 3),
            ForwardInput([9, 10], 14, [50, 51, 52, 53], 2),
        ],
    ]
    for inputs in cases:
        assert all(stack_and_loop_agree(runner, inputs)), inputs


def test_engine_greedy_with_and_without_the_stack_and_speculation(
    gemma_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain greedy with the stack equals the Python loop's; n-gram and self-draft speculation
    (verify queries through the stack, drafts through the draft's) equal plain."""
    prompts = [p * 3 for p in random_prompts(4, (4, 9), 300, seed=5)]  # past the window
    kw = dict(quantization="gguf", dtype="bfloat16", max_num_batched_tokens=9)
    engine = make_engine(gemma_gguf, **kw)
    assert engine.target.model.native_stack is not None
    calls: list[int] = []
    stack = engine.target.model.native_stack
    forward = stack.stack.forward

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return forward(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(stack, "stack", type("Wrapped", (), {"forward": staticmethod(counted)}))
    plain = outputs(engine, prompts, greedy(16))
    assert calls
    for spec in (
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
        SpeculativeConfig(
            method="draft", num_speculative_tokens=3, adaptive=False, draft_model=str(gemma_gguf)
        ),  # fmt: skip
    ):
        assert (
            outputs(make_engine(gemma_gguf, speculative=spec, **kw), prompts, greedy(16)) == plain
        )
    monkeypatch.setattr(decoder_stack, "ENABLED", False)
    assert outputs(make_engine(gemma_gguf, **kw), prompts, greedy(16)) == plain


def test_other_families_with_windows_or_sinks_keep_the_python_loop() -> None:
    """The stack takes Llama's layer and Gemma 3's, nothing in between."""
    from engine.model.shape import DecoderShape

    base = DecoderShape(32, 64, 128, 2, 4, 2, 16, 1e-6, False, False, True, True, norm_offset=True,
                        activation="gelu_tanh", sandwich_norms=True, sliding_window=8,
                        layer_types=("sliding_attention", "full_attention"))  # fmt: skip
    assert decoder_stack.is_gemma(base) and not decoder_stack.is_llama(base)
    from dataclasses import replace

    for odd in (dict(attention_sinks=True), dict(activation="silu"), dict(sliding_window=None),
                dict(qk_norm_flat=True), dict(residual_multiplier=2.0), dict(v_norm=True),
                dict(layer_scalar=True), dict(global_head_dim=32)):  # fmt: skip
        assert not decoder_stack.is_gemma(replace(base, **odd)), odd  # type: ignore[arg-type]
