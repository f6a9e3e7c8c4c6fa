"""The GGUF block GEMM: every format x every ISA variant this CPU runs against the scalar
reference and against gguf's own dequantization, shape checks, batch and thread invariance.

Variants the CPU lacks are skipped with the reason; CI hosts without AVX512 still test AVX2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_blocks import random_blocks

from engine.kernels import gguf_ops

pytestmark = pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++")) or not gguf_ops.available(),
    reason="the native kernels did not build here (the fallback is tested in test_gguf_linear.py)",
)

TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.MXFP4, T.Q4_K, T.Q5_K, T.Q6_K]
ALL_VARIANTS = ["avx512vnni", "avxvnni", "avx2", "scalar"]


def variant_param(name: str) -> object:
    present = not gguf_ops.available() or name in gguf_ops.variants()
    return pytest.param(
        name, marks=pytest.mark.skipif(not present, reason=f"this CPU lacks {name}")
    )


VARIANTS = [variant_param(name) for name in ALL_VARIANTS]
# The file's formats and the layouts repacked at load (which the scalar reference also
# multiplies, on any CPU): Q4_K_X for the AVX512-VNNI tiles, Q4_K / Q6_K with 16 rows interleaved.
PACKED = {
    "Q4_K_X": (T.Q4_K, "tiles"),
    "Q4_K_R16": (T.Q4_K, "rows16"),
    "Q6_K_R16": (T.Q6_K, "rows16"),
    "Q4_0_R16": (T.Q4_0, "rows16"),
    "Q5_0_R16": (T.Q5_0, "rows16"),
    "Q8_0_R16": (T.Q8_0, "rows16"),
    "MXFP4_R16": (T.MXFP4, "rows16"),
}
ROWS16_FORMS = [form for form in PACKED if form.endswith("_R16")]
FORMS = [t.name for t in TYPES] + list(PACKED)
ROWS16_VARIANTS = {
    "avx512vnni",
    "avxvnni",
    "avx2",
    "scalar",
}  # those with kernels for the interleaved layouts


def file_type(form: str) -> T:
    return PACKED[form][0] if form in PACKED else T[form]


def operands(form: str, blocks: torch.Tensor, variant: str) -> tuple[torch.Tensor, int]:
    """The blocks as `variant` multiplies them for this form, and the type id to pass."""
    if form not in PACKED:
        return blocks, int(T[form])
    if form == "Q4_K_X" and variant in ("avx2", "avxvnni"):
        pytest.skip(f"Q4_K_X is the avx512vnni layout; {variant} multiplies Q4_K as stored")
    if form != "Q4_K_X" and variant not in ROWS16_VARIANTS:
        pytest.skip(f"{variant} has no kernel for the 16-row layouts")
    if form == "Q8_0_R16" and variant == "avx2":
        pytest.skip("avx2 multiplies Q8_0 as stored (its values overflow vpmaddubsw's pairs)")
    qtype, layout = PACKED[form]
    return gguf_ops.pack(blocks, int(qtype), "avx512vnni", layout)


def gguf_reference(blocks: torch.Tensor, qtype: T) -> torch.Tensor:  # [N, K] float64
    return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).astype(np.float64))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
def test_integer_products_are_exact(form: str, variant: str) -> None:
    """Activations that round to themselves (integers, 127 in every group of 16) and power-of-two
    scales make every product and sum exact in float32: each variant must then equal the float64
    product of gguf's dequantization exactly."""
    k, n = 256, 24
    qtype = file_type(form)
    blocks = random_blocks(qtype, n, k, seed=1, scale=2.0**-10)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (5, k), generator=gen).float()
    x[:, ::16] = 127.0  # every group's max: the activation scale is exactly 1
    got = gguf_ops.mm(x, *operands(form, blocks, variant), variant)
    want = x.double() @ gguf_reference(blocks, qtype).T
    assert torch.equal(got.double(), want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
def test_variant_within_rounding_bound_of_gguf_dequantize(form: str, variant: str) -> None:
    """Rounding a group of 16 activations to int8 moves each value by at most amax / 254 (half a
    step of amax / 127), so |error| <= sum over groups of amax_g / 254 * sum_g |w|; float32 sums
    add at most 1e-5 of sum |x||w|."""
    k, n, m = 512, 40, 6
    qtype = file_type(form)
    values = 16  # activations are rounded per 16 values, whatever the weight format
    blocks = random_blocks(qtype, n, k, seed=2)
    w = gguf_reference(blocks, qtype)  # [N, K]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).double()
    amax = x.abs().view(m, -1, values).amax(-1)  # [M, K / values]
    w_abs = w.abs().view(n, -1, values).sum(-1)  # [N, K / values]
    bound = (amax / 254) @ w_abs.T + 1e-5 * (x.abs() @ w.abs().T)
    got = gguf_ops.mm(x.float(), *operands(form, blocks, variant), variant).double()
    err = (got - x @ w.T).abs()
    assert (err <= bound).all(), f"worst error {err.max():.3g} against bound {bound.min():.3g}"
    assert err.max() > 0  # the activations were rounded: the bound is not vacuous


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", FORMS)
def test_variant_close_to_scalar_reference(form: str, variant: str) -> None:
    """Same integer products, float accumulation in another order: within 1e-5 of sum |x||w|."""
    k, n, m = 768, 33, 9
    qtype = file_type(form)
    blocks = random_blocks(qtype, n, k, seed=3)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    got = gguf_ops.mm(x, *operands(form, blocks, variant), variant)
    ref = gguf_ops.mm(x, blocks, int(qtype), "scalar")
    scale = x.abs() @ gguf_ops.dequantize(blocks, int(qtype)).abs().T
    assert ((got - ref).abs() <= 1e-5 * scale).all()


@pytest.mark.parametrize("form", FORMS)
def test_dequantize_equals_gguf(form: str) -> None:
    qtype = file_type(form)
    blocks = random_blocks(qtype, 7, 512, seed=4)
    ours = gguf_ops.dequantize(*operands(form, blocks, "avx512vnni")).double()
    assert torch.equal(ours, gguf_reference(blocks, qtype))


@pytest.mark.parametrize("n", [16, 37, 5])
@pytest.mark.parametrize("form", ROWS16_FORMS)
def test_rows16_layout_moves_every_value(form: str, n: int) -> None:
    """Full groups of 16 rows, a tail of N % 16 rows, or only a tail: each weight row dequantizes
    to the file's row, and the packed tensor keeps one row per weight row."""
    qtype, layout = PACKED[form]
    blocks = random_blocks(qtype, n, 512, seed=8)
    packed, packed_type = gguf_ops.pack(blocks, int(qtype), "avx512vnni", layout)
    assert packed_type == getattr(gguf_ops, form) and packed.shape[0] == n
    ours = gguf_ops.dequantize(packed, packed_type).double()
    assert torch.equal(ours, gguf_reference(blocks, qtype))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ROWS16_FORMS)
@pytest.mark.parametrize("k", [256, 1024])
def test_rows16_equals_the_per_row_layout_exactly_in_integers(
    form: str, variant: str, k: int
) -> None:
    """K of one block and of four, N = 16 * 3 + 7 (a tail): exact products as in
    test_integer_products_are_exact, so the interleaved kernel must equal the reference bit for bit."""
    n = 55
    qtype = file_type(form)
    blocks = random_blocks(qtype, n, k, seed=9, scale=2.0**-10)
    gen = torch.Generator().manual_seed(9)
    x = torch.randint(-5, 6, (9, k), generator=gen).float()
    x[:, ::16] = 127.0
    got = gguf_ops.mm(x, *operands(form, blocks, variant), variant)
    want = x.double() @ gguf_reference(blocks, qtype).T
    assert torch.equal(got.double(), want)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ["Q4_K", "Q6_K", "Q8_0", "MXFP4", "Q4_K_X", *ROWS16_FORMS])
def test_a_row_is_the_same_alone_or_in_any_batch(form: str, variant: str) -> None:
    k, n = 512, 37  # two full groups of 16 and a tail of 5
    blocks, qtype = operands(form, random_blocks(file_type(form), n, k, seed=5), variant)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([gguf_ops.mm(x[i : i + 1], blocks, qtype, variant) for i in range(16)])
    for m in range(1, 17):
        batch = gguf_ops.mm(x[16 - m :], blocks, qtype, variant)
        assert torch.equal(batch, alone[16 - m :]), f"rows {16 - m}.. in a batch of {m}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "form", ["Q4_K", "Q6_K", "Q5_0", "Q4_K_X", "Q4_K_R16", "Q6_K_R16", "Q5_0_R16", "MXFP4_R16"]
)
def test_two_activation_passes(form: str, variant: str) -> None:
    """The second pass rounds what the first left: within the bound of a rounding of the
    residual (its amax / 254 per group, ~1/127 of the first's), a row the same alone or in any
    batch, and the variant's result close to the scalar reference's."""
    k, n, m = 512, 37, 12
    qtype = file_type(form)
    values = 16
    raw = random_blocks(qtype, n, k, seed=7)
    blocks, packed = operands(form, raw, variant)
    w = gguf_reference(raw, qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    x[:, 5] = 40.0  # an outlier channel, as real activations have
    exact = x.double() @ w.T
    one = gguf_ops.mm(x, blocks, packed, variant).double()
    two = gguf_ops.mm(x, blocks, packed, variant, passes=2).double()
    amax = x.double().abs().view(m, -1, values).amax(-1)
    w_abs = w.abs().view(n, -1, values).sum(-1)
    bound = (amax / 254 / 127) @ w_abs.T * 1.01 + 1e-5 * (x.double().abs() @ w.abs().T)
    assert ((two - exact).abs() <= bound).all()
    assert (two - exact).abs().mean() < (one - exact).abs().mean() / 20
    for i in range(m):
        alone = gguf_ops.mm(x[i : i + 1], blocks, packed, variant, passes=2)
        assert torch.equal(alone[0], two[i].float()), i
    ref = gguf_ops.mm(x, raw, int(qtype), "scalar", passes=2).double()
    assert ((two - ref).abs() <= 1e-5 * (x.double().abs() @ w.abs().T)).all()


@pytest.mark.parametrize("form", ["Q4_K", "Q6_K", "Q5_0", "Q4_K_R16", "Q6_K_R16", "MXFP4_R16"])
def test_one_and_two_threads_agree(form: str) -> None:
    blocks, qtype = operands(form, random_blocks(file_type(form), 300, 512, seed=6), "avx512vnni")
    x = torch.randn(11, 512, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gguf_ops.mm(x, blocks, qtype)
        torch.set_num_threads(2)
        two = gguf_ops.mm(x, blocks, qtype)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


# MXFP4 (gpt-oss's experts): odd row counts and tails of 16-row groups, one block (K = 32, an odd
# block count for the AVX512 tiles that take blocks in pairs) up to gpt-oss's hidden width.
MXFP4_SHAPES = [(1, 32), (7, 64), (17, 96), (33, 2880)]  # (N, K)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ["MXFP4", "MXFP4_R16"])
@pytest.mark.parametrize(("n", "k"), MXFP4_SHAPES)
def test_mxfp4_shapes_and_row_counts(form: str, variant: str, n: int, k: int) -> None:
    """1 to 8 rows: exact integer products equal gguf's dequantization bit for bit; random rows
    stay within 1e-5 of sum |x||w| of the scalar reference on the file's blocks."""
    raw = random_blocks(T.MXFP4, n, k, seed=n, scale=2.0**-6)
    blocks, qtype = operands(form, raw, variant)
    w = gguf_reference(raw, T.MXFP4)  # [N, K]
    gen = torch.Generator().manual_seed(k)
    exact_x = torch.randint(-4, 5, (8, k), generator=gen).float()
    exact_x[:, ::16] = 127.0
    noisy_x = torch.randn(8, k, generator=gen)
    for m in range(1, 9):
        got = gguf_ops.mm(exact_x[:m], blocks, qtype, variant).double()
        assert torch.equal(got, exact_x[:m].double() @ w.T), f"{m} rows"
        got = gguf_ops.mm(noisy_x[:m], blocks, qtype, variant)
        ref = gguf_ops.mm(noisy_x[:m], raw, int(T.MXFP4), "scalar")
        scale = noisy_x[:m].abs() @ w.abs().float().T
        assert ((got - ref).abs() <= 1e-5 * scale).all(), f"{m} rows"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's 12 * 2^127
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("form", ["MXFP4", "MXFP4_R16"])
def test_mxfp4_every_scale_byte(form: str, variant: str) -> None:
    """E8M0 bytes 0..255 dequantize as gguf does (0 and 1 are subnormal floats); the kernels read
    the smallest ones (subnormal scales) right too."""
    raw = random_blocks(T.MXFP4, 16 * 3, 512, seed=11)
    raw.view(-1, 17)[:, 0] = torch.arange(256, dtype=torch.uint8).repeat(3)  # 768 blocks
    blocks, qtype = operands(form, raw, "avx512vnni")
    assert torch.equal(gguf_ops.dequantize(blocks, qtype).double(), gguf_reference(raw, T.MXFP4))
    raw.view(-1, 17)[:, 0] = torch.arange(768, dtype=torch.uint8) % 4  # 2^-128 .. 2^-125
    blocks, qtype = operands(form, raw, variant)
    w = gguf_reference(raw, T.MXFP4)
    x = torch.randint(-4, 5, (3, 512), generator=torch.Generator().manual_seed(11)).float()
    x[:, ::16] = 127.0
    got = gguf_ops.mm(x, blocks, qtype, variant).double()
    assert ((got - x.double() @ w.T).abs() <= 1e-6 * (x.double().abs() @ w.abs().T)).all()


def test_odd_shapes_are_rejected_with_a_reason() -> None:
    blocks = random_blocks(T.Q4_K, 4, 512)
    with pytest.raises(RuntimeError, match="not a multiple of the Q4_K block"):
        gguf_ops.mm(torch.randn(2, 500), blocks, int(T.Q4_K))
    with pytest.raises(RuntimeError, match="weight rows hold 512 values"):
        gguf_ops.mm(torch.randn(2, 768), blocks, int(T.Q4_K))
    with pytest.raises(RuntimeError, match="not supported"):
        gguf_ops.mm(torch.randn(2, 512), blocks, int(T.Q2_K))
    with pytest.raises(RuntimeError, match="float32"):
        gguf_ops.mm(torch.randn(2, 512, dtype=torch.float64), blocks, int(T.Q4_K))
    assert not gguf_ops.supports(int(T.Q4_K), 500) and gguf_ops.supports(int(T.Q4_K), 512)


def test_traced_by_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = gguf_ops.mm(torch.empty(3, 512), torch.empty(10, 288, dtype=torch.uint8), int(T.Q4_K))
        dense = gguf_ops.dequantize(torch.empty(10, 288, dtype=torch.uint8), int(T.Q4_K))
    assert out.shape == (3, 10) and dense.shape == (10, 512)


def _bundled_target() -> Path | None:
    path = Path.home() / ".cache" / "specserve" / "models" / "qwen2.5-coder-1.5b-instruct.gguf"
    return path if path.exists() else None


@pytest.mark.skipif(_bundled_target() is None, reason="the bundled target is not cached here")
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "output.weight"])
def test_a_real_tensor_against_gguf(name: str) -> None:
    """Q4_K (attn_q) and Q6_K (the head) rows read from the bundled file."""
    from engine.model.quant.gguf_file import read_gguf

    path = _bundled_target()
    assert path is not None
    tensor = next(t for t in read_gguf(path)[1] if t.name == name)
    blocks = torch.from_numpy(np.array(tensor.data[:64]))
    w = gguf_reference(blocks, tensor.tensor_type)
    assert torch.equal(gguf_ops.dequantize(blocks, int(tensor.tensor_type)).double(), w)
    x = torch.randn(4, w.shape[1], generator=torch.Generator().manual_seed(7)).double()
    want = x @ w.T
    for layout in ("tiles", "rows16"):  # the file's rows, and 16-row groups (64 rows: 4 groups)
        packed, qtype = gguf_ops.pack(blocks, int(tensor.tensor_type), layout=layout)
        got = gguf_ops.mm(x.float(), packed, qtype).double()
        assert ((got - want).norm() / want.norm()).item() < 1e-2  # int8 activations: ~0.5% here
