"""Qwen3-MoE on the native path: the routed experts as one native call a step
(engine/model/quant/native_experts.py, csrc/moe.cpp) bit for bit the eager grouping, and its
layers (q/k norms, router, experts) in the native stack bit for bit the Python loop; Qwen3's
dense layer (q/k norms) in the stack too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, make_engine, outputs
from gguf import GGMLQuantizationType as T
from gguf_families import write_family_gguf
from stack_utils import stack_and_loop_agree
from test_qwen3_moe_gguf import QWEN3_MOE, _ngram, _prompts, write_qwen3_moe_gguf
from tiny import make_tiny_model

from engine.config import SpeculativeConfig
from engine.kernels import gguf_ops
from engine.model import decoder_stack
from engine.model.loader import load_model
from engine.model.moe import MoE
from engine.model.quantize import gguf_kernels
from engine.model.runner import ForwardInput, ModelRunner

pytestmark = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", params=[T.Q8_0, T.Q4_K], ids=["Q8_0", "Q4_K"])
def moe_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Experts of width 256 so that Q4_K's super-blocks fit their down matrix."""
    tmp = tmp_path_factory.mktemp("moe-stack")
    config = QWEN3_MOE | dict(hidden_size=256, moe_intermediate_size=256, num_layers=3)
    config |= dict(num_experts=8, num_experts_per_tok=3)
    src = make_tiny_model(tmp / "src", seed=11, **config)  # type: ignore[arg-type]
    return write_qwen3_moe_gguf(tmp / f"moe-{request.param.name}.gguf", src, request.param)


def _runner(path: Path, dtype: torch.dtype) -> ModelRunner:
    name = str(dtype).removeprefix("torch.")
    runner = ModelRunner(load_model(str(path), "gguf"), "cpu", name, 16)  # type: ignore[arg-type]
    runner.allocate_kv_cache(64)
    return runner


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_native_experts_equal_the_eager_grouping(moe_gguf: Path, dtype: torch.dtype) -> None:
    """The same routing, then the experts by the native call and by one gguf_mm per chosen
    expert and matrix: bit for bit, and each row alone as in a batch."""
    runner = _runner(moe_gguf, dtype)
    moe = runner.model.layers[0].mlp
    assert isinstance(moe, MoE) and moe.native is not None
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(0)).to(dtype).float()
    with torch.no_grad():
        for rows in (x, x[:1], x[3:5]):
            weights, ids = moe.gate(rows, dtype, native=True)
            assert torch.equal(
                moe.native.forward(rows, ids, weights), moe.grouped(rows, dtype, weights, ids)
            )
        batched = moe(x, dtype)
        assert torch.equal(batched[:1], moe(x[:1], dtype)) and torch.equal(
            batched[3:5], moe(x[3:5], dtype)
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_equals_the_python_loop(moe_gguf: Path, dtype: str) -> None:
    """Decodes, a verify query and a batch of both (llama.cpp's qwen3moe routes every layer)."""
    runner = _runner(moe_gguf, getattr(torch, dtype))
    assert runner.model.native_stack is not None
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    runner.forward([ForwardInput(prompt, 0, [0, 1, 2, 3], 1)])
    cases = [
        [ForwardInput([7], 40, [0, 1, 2, 3], 1)],
        [ForwardInput([7, 8, 9, 10, 11], 40, [0, 1, 2, 3], 5)],
        [ForwardInput([7], 40, [0, 1, 2, 3], 1), ForwardInput([5, 6, 7], 15, [4, 5], 3)],
    ]
    for inputs in cases:
        assert all(stack_and_loop_agree(runner, inputs)), inputs


def test_engine_greedy_with_the_stack_speculative_and_plain(
    moe_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain greedy with the stack equals the Python loop's; n-gram and draft-model speculation
    (the file as its own draft) give the same text. Fresh engines each: a second run on one
    engine would start from its prefix cache, whose prompt chunks round otherwise."""
    engine = make_engine(moe_gguf, quantization="gguf", dtype="bfloat16", block_size=16)
    assert engine.target.model.native_stack is not None
    want = outputs(engine, _prompts(), greedy(10))
    draft = SpeculativeConfig(
        method="draft", num_speculative_tokens=3, draft_model=str(moe_gguf), adaptive=False
    )
    for spec in (_ngram(), draft):
        spec_engine = make_engine(
            moe_gguf, quantization="gguf", dtype="bfloat16", block_size=16, speculative=spec
        )
        assert outputs(spec_engine, _prompts(), greedy(10)) == want
    monkeypatch.setattr(decoder_stack, "ENABLED", False)
    plain = make_engine(moe_gguf, quantization="gguf", dtype="bfloat16", block_size=16)
    assert plain.target.model.native_stack is None
    assert outputs(plain, _prompts(), greedy(10)) == want


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen3_dense_layers_take_the_stack(tmp_path: Path, dtype: str) -> None:
    """Qwen3's q/k norms (per head, rounded before the weight) in the native Llama layer."""
    src = make_tiny_model(tmp_path / "src", family="qwen3", hidden_size=256, num_layers=2)
    path = tmp_path / "qwen3.gguf"
    write_family_gguf(path, src, T.Q8_0)
    runner = _runner(path, getattr(torch, dtype))
    assert runner.model.shape.qk_norm and runner.model.native_stack is not None
    prompt = torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    runner.forward([ForwardInput(prompt, 0, [0, 1, 2], 1)])
    for inputs in (
        [ForwardInput([5], 30, [0, 1, 2], 1)],
        [ForwardInput([5, 6, 7], 30, [0, 1, 2], 3)],
    ):
        assert all(stack_and_loop_agree(runner, inputs)), inputs


def test_every_gguf_matrix_shares_one_buffer(moe_gguf: Path) -> None:
    """Loaded, every GGUF matrix (attention, experts, head) is a view of one buffer advised onto
    2 MB pages; the native call and the stack read those same views."""
    runner = _runner(moe_gguf, torch.bfloat16)
    kernels = gguf_kernels(runner.model)
    assert len(kernels) > 3 * 8 * 2  # every expert's gate_up and down, and more
    assert len({k.blocks.untyped_storage().data_ptr() for k in kernels}) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_router_logits_kernel(dtype: torch.dtype) -> None:
    """Every ISA variant the same bits, each row alone as in any batch, and torch's own
    `F.linear(x.to(dtype), W)` within a rounding of the model dtype."""
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(128, 2048, generator=gen) * 0.02).to(dtype)
    x = torch.randn(7, 2048, generator=gen)
    ops = torch.ops.specserve_kernels
    variants = ["scalar"] + [v for v in ("avx2", "avx512") if ops.cpu_supports(v)]
    outs = [ops.router_logits(x, weight, isa) for isa in variants]
    assert all(torch.equal(outs[0], out) for out in outs[1:])
    assert all(
        torch.equal(ops.router_logits(x[i : i + 1], weight), outs[0][i : i + 1]) for i in range(7)
    )
    want = torch.nn.functional.linear(x.to(dtype), weight).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2 * 2**-8 * want.abs().max().item()
    assert (outs[0].float() - want).abs().max().item() <= tolerance
