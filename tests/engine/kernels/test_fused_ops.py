"""The fused small ops (engine/kernels/csrc/fused.cpp): every ISA variant bit-identical to the
others, the eager ops' roundings, a row's result independent of its batch, and a model's
forward with them against the eager one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import make_tiny_model

from engine.kernels import fused_ops
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

pytestmark = pytest.mark.skipif(not fused_ops.loaded(), reason="native kernels not built")
_VARIANTS = (("avx2", "avx2"), ("avx512", "avx512"))  # (isa argument, CPU tier)
ISAS = ["scalar"] + [
    isa
    for isa, flag in _VARIANTS
    if fused_ops.loaded() and torch.ops.specserve_kernels.cpu_supports(flag)
]
DTYPES = [torch.bfloat16, torch.float32]


def _rows(m: int, n: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, generator=g) * scale).to(dtype)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference, in units of dtype's last place at b's magnitude."""
    eps = torch.finfo(dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs() * eps).clamp_min(1e-30)).max())


def _assert_matches_eager(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """bfloat16: equal to the eager op but for a rare last-place difference (the sum of squares
    and exp are computed in another order); float32 keeps those last bits: close, not equal."""
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
        return
    same = (out == ref).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the values equal the eager op's"
    assert _ulps_apart(out, ref, dtype) <= 2.0  # a last place moved before the weight multiplies


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [100, 1536])  # a tail past the 16 lanes, and the 1.5B's width
def test_add_rmsnorm_matches_eager_and_every_isa_agrees(dtype: torch.dtype, n: int) -> None:
    x, residual = _rows(7, n, dtype, 0), _rows(7, n, dtype, 1, scale=4.0)
    weight = _rows(1, n, dtype, 2)[0].abs() + 0.5
    ref = fused_ops.rmsnorm_reference(x + residual, weight, 1e-6, torch.float32)
    outs = []
    for isa in ISAS:
        out, total = fused_ops.add_rmsnorm(x, residual, weight, 1e-6, torch.float32, isa)
        assert torch.equal(total, x + residual)
        outs.append(out)
    for out in outs:
        assert torch.equal(out, outs[0])
    _assert_matches_eager(outs[0], ref, dtype)
    plain = fused_ops.rmsnorm(x + residual, weight, 1e-6, dtype)
    assert plain.dtype == dtype and torch.equal(plain.float(), outs[0])


def test_add_rmsnorm_rounds_a_float32_gemm_output_first() -> None:
    x = _rows(6, 1536, torch.float32, 12, scale=3.0)  # o_proj's or down_proj's unrounded output
    residual, weight = _rows(6, 1536, torch.bfloat16, 13), _rows(1, 1536, torch.bfloat16, 14)[0]
    total = x.to(torch.bfloat16) + residual
    outs = []
    for isa in ISAS:
        out, got = fused_ops.add_rmsnorm(x, residual, weight, 1e-6, torch.float32, isa)
        assert got.dtype == torch.bfloat16 and torch.equal(got, total)
        outs.append(out)
    for out in outs:
        assert torch.equal(out, outs[0])
    ref = fused_ops.rmsnorm_reference(total, weight, 1e-6, torch.float32)
    _assert_matches_eager(outs[0], ref, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_eager_and_every_isa_agrees(dtype: torch.dtype) -> None:
    gate_up = _rows(5, 2 * 1000, torch.float32, 3, scale=4.0)  # a GGUF GEMM's float32 output
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 90.0, -90.0, 200.0, -200.0, 1e-8, -1e-8])
    ref = fused_ops.silu_mul_reference(gate_up, dtype, torch.float32)
    outs = [fused_ops.silu_mul(gate_up, dtype, torch.float32, isa) for isa in ISAS]
    for out in outs:
        assert torch.equal(out, outs[0])
    _assert_matches_eager(outs[0], ref, dtype)
    rounded = fused_ops.silu_mul(gate_up.to(dtype), dtype, dtype)
    assert torch.equal(rounded.float(), outs[0])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16, 64])  # 64: past the one-thread grain
def test_a_rows_result_does_not_depend_on_its_batch(rows: int) -> None:
    x, residual = _rows(rows, 1536, torch.bfloat16, 4), _rows(rows, 1536, torch.bfloat16, 5)
    weight = _rows(1, 1536, torch.bfloat16, 6)[0]
    gate_up = _rows(rows, 2 * 8960, torch.float32, 7)
    out, _ = fused_ops.add_rmsnorm(x, residual, weight, 1e-6, torch.float32)
    act = fused_ops.silu_mul(gate_up, torch.bfloat16, torch.float32)
    for i in (0, rows - 1):
        alone, _ = fused_ops.add_rmsnorm(
            x[i : i + 1], residual[i : i + 1], weight, 1e-6, torch.float32
        )
        assert torch.equal(out[i : i + 1], alone)
        assert torch.equal(
            act[i : i + 1], fused_ops.silu_mul(gate_up[i : i + 1], torch.bfloat16, torch.float32)
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 12, 2), (5, 4, 4), (70, 14, 2)])
def test_rope_write_kv_equals_apply_rope_and_write_kv(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int
) -> None:
    """Bit for bit the eager rotation and cache write, from the qkv GEMM's split (a strided
    view), to random slots of a pool; the slots it does not write keep their values."""
    from engine.model.attention import write_kv
    from engine.model.decoder import apply_rope

    dim, block, blocks = 64, 16, 12
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
    qk, v = qk.view(tokens, heads + kv_heads, dim), v.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, 1, dim, generator=g) * 6.3
    cos, sin = (
        angles.cos().to(dtype),
        (angles.sin() * torch.where(torch.arange(dim) < dim // 2, -1.0, 1.0)).to(dtype),
    )
    slots = torch.randperm(blocks * block, generator=g)[:tokens]
    pool = torch.randn(kv_heads, blocks, block, dim, generator=g).to(dtype)
    k_ref, v_ref, k_out, v_out = pool.clone(), pool.clone() * 2, pool.clone(), pool.clone() * 2

    q_ref, k = apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)
    write_kv(k_ref, v_ref, k, v, slots)
    q = fused_ops.rope_write_kv(qk, v, cos, sin, k_out, v_out, slots, heads)

    assert q.shape == (tokens, heads, dim) and q.is_contiguous()
    assert torch.equal(q, q_ref)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


def test_rope_write_kv_rejects_a_slot_outside_the_pool() -> None:
    qk, v = torch.randn(1, 3, 8), torch.randn(1, 1, 8)
    cos, sin = torch.ones(1, 1, 8), torch.zeros(1, 1, 8)
    pool = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        fused_ops.rope_write_kv(qk, v, cos, sin, pool, pool.clone(), torch.tensor([8]), 2)


def test_the_ops_trace_under_torch_compile() -> None:
    def layer(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
        h, total = fused_ops.add_rmsnorm(x, r, w, 1e-6, torch.float32)
        return (
            h.sum()
            + total.float().sum()
            + fused_ops.silu_mul(gu, torch.bfloat16, torch.float32).sum()
        )

    x, r = _rows(3, 64, torch.bfloat16, 8), _rows(3, 64, torch.bfloat16, 9)
    w, gu = _rows(1, 64, torch.bfloat16, 10)[0], _rows(3, 128, torch.float32, 11)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, r, w, gu), layer(x, r, w, gu))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("fused") / "m", hidden_size=256, intermediate_size=512
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_forward_with_the_fused_ops_matches_the_eager_one(
    tiny_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = ModelRunner(load_model(str(tiny_dir), "none"), "cpu", dtype, 4)
    runner.allocate_kv_cache(32)
    ids = [5, 17, 3, 99, 42, 7]
    step = [ForwardInput(ids, 0, list(range(8)), len(ids))]
    fused = runner.forward(step)
    monkeypatch.setattr(fused_ops, "ENABLED", False)
    eager = runner.forward(step)
    tolerance = 0.05 if dtype == "bfloat16" else 1e-4  # a last-place flip moves bf16 logits
    torch.testing.assert_close(fused, eager, rtol=tolerance, atol=tolerance)
    assert torch.equal(fused.argmax(-1), eager.argmax(-1))
