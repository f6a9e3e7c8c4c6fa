"""The bf16 prefill ops (engine/kernels/csrc/prefill.cpp): GGUF blocks to bf16, and the
panel-tiled bf16 GEMM, against float references; SIMD against the portable path; 1 vs 2 threads."""

from __future__ import annotations

import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_blocks import random_blocks

from engine.kernels import gguf_ops

pytestmark = pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")) or not gguf_ops.has_prefill_ops(),
    reason="the native kernels did not build here",
)

FORMS = [
    "Q4_0",
    "Q5_0",
    "Q8_0",
    "MXFP4",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q4_K_X",
    "Q4_K_R16",
    "Q6_K_R16",
    "Q4_0_R16",
    "Q5_0_R16",
    "Q8_0_R16",
    "MXFP4_R16",
]
ISAS = ["scalar", "avx2", "avx512", ""]


def operands(form: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, int]:
    """The blocks as stored, or repacked: Q4_K_X, and the 16-row interleaved layouts (whose rows
    dequantize by groups; n = 37 leaves a tail of 5 rows stored per row)."""
    if form == "Q4_K_X":
        return gguf_ops.pack(
            random_blocks(T.Q4_K, n, k, seed=seed), int(T.Q4_K), "avx512vnni", "tiles"
        )
    if form.endswith("_R16"):
        qtype = T[form.removesuffix("_R16")]
        return gguf_ops.pack(
            random_blocks(qtype, n, k, seed=seed), int(qtype), "avx512vnni", "rows16"
        )
    return random_blocks(T[form], n, k, seed=seed), int(T[form])


def isa_or_skip(isa: str) -> str:
    if isa == "avx512" and not torch.ops.specserve_kernels.cpu_supports("avx512"):
        pytest.skip("this CPU lacks avx512")
    if isa == "avx2" and not torch.ops.specserve_kernels.cpu_supports("avx2"):
        pytest.skip("this CPU lacks avx2")
    return isa


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:  # bf16 tensors, same signs
    bits = [t.view(torch.int16).int() for t in (a, b)]
    return int((bits[0] - bits[1]).abs().max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("form", FORMS)
def test_dequantize_bf16_is_the_float_dequantization_rounded(form: str, isa: str) -> None:
    blocks, qtype = operands(form, 37, 512, seed=1)
    ours = gguf_ops.dequantize_bf16(blocks, qtype, isa_or_skip(isa))
    reference = gguf_ops.dequantize(blocks, qtype).to(torch.bfloat16)
    assert ours.shape == reference.shape and ours.dtype == torch.bfloat16
    # the SIMD loops may fuse scale * q - min into one FMA: at most one bf16 step apart, rarely
    assert _ulps_apart(ours, reference) <= 1
    assert (ours == reference).float().mean() > 0.99


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "form", ["Q4_K", "Q6_K", "Q8_0", "Q4_K_X", "Q4_K_R16", "Q6_K_R16", "Q5_0_R16"]
)
@pytest.mark.parametrize("shape", [(1, 300, 256), (37, 97, 512), (130, 300, 1024)])
def test_mm_bf16_against_dense_linear(form: str, isa: str, shape: tuple[int, int, int]) -> None:
    m, n, k = shape  # odd row counts, N not a multiple of the panel
    blocks, qtype = operands(form, n, k, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    weight = gguf_ops.dequantize(blocks, qtype)  # [N, K] float32
    reference = x.float() @ weight.bfloat16().float().T
    for panel in (16, 64, 256):
        out = torch.ops.specserve_kernels.gguf_mm_bf16(x, blocks, qtype, panel, isa_or_skip(isa))
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        torch.testing.assert_close(
            out.float(), reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item()
        )


def test_mm_bf16_one_and_two_threads_agree() -> None:
    blocks, qtype = operands("Q4_K", 300, 512, seed=3)
    x = torch.randn(45, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_ops.mm_bf16(x, blocks, qtype), gguf_ops.dequantize_bf16(blocks, qtype)
        torch.set_num_threads(2)
        two = gguf_ops.mm_bf16(x, blocks, qtype), gguf_ops.dequantize_bf16(blocks, qtype)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[1], two[1])
    torch.testing.assert_close(one[0], two[0], rtol=0, atol=0)  # panels do not depend on threads


def test_mm_bf16_rejects_bad_inputs() -> None:
    blocks, qtype = operands("Q4_K", 4, 512, seed=4)
    with pytest.raises(RuntimeError, match="bf16"):
        gguf_ops.mm_bf16(torch.randn(2, 512), blocks, qtype)
    with pytest.raises(RuntimeError, match="K = 256"):
        gguf_ops.mm_bf16(torch.randn(2, 256).bfloat16(), blocks, qtype)
    with pytest.raises(RuntimeError, match="unknown isa"):
        gguf_ops.dequantize_bf16(blocks, qtype, "sse9")


def test_panel_rows_fit_the_budget() -> None:
    for k in (256, 1536, 8960):
        rows = gguf_ops.panel_rows(k)
        assert 32 <= rows <= 256 and rows & (rows - 1) == 0
        assert rows == 32 or rows * k * 2 <= gguf_ops.PANEL_BYTES


def test_traced_by_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        blocks = torch.empty(10, 288, dtype=torch.uint8)
        out = gguf_ops.mm_bf16(torch.empty(3, 512, dtype=torch.bfloat16), blocks, int(T.Q4_K))
        dense = gguf_ops.dequantize_bf16(blocks, int(T.Q4_K))
    assert out.shape == (3, 10) and dense.shape == (10, 512) and dense.dtype == torch.bfloat16


def test_mm_bf16_under_inference_mode() -> None:
    """The engine's forward runs in inference mode; the worker threads write its output."""
    blocks, qtype = operands("Q4_K", 300, 512, seed=5)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    want = gguf_ops.mm_bf16(x, blocks, qtype)
    with torch.inference_mode():
        got = gguf_ops.mm_bf16(x, blocks, qtype)
    assert torch.equal(got, want)


def test_mm_bf16_a_row_is_the_same_alone_or_in_any_batch() -> None:
    """Every GEMM call has one shape (64-row blocks, the last padded): a prompt chunk's rows do
    not depend on what shares its step, which keeps speculative greedy equal to plain."""
    blocks, qtype = operands("Q4_K", 300, 512, seed=6)
    x = torch.randn(150, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    alone = torch.cat([gguf_ops.mm_bf16(x[i : i + 1], blocks, qtype) for i in range(0, 150, 7)])
    for m in (1, 17, 64, 65, 130, 150):
        batch = gguf_ops.mm_bf16(x[:m], blocks, qtype)
        assert torch.equal(batch[::7], alone[: len(range(0, m, 7))]), f"a batch of {m}"
