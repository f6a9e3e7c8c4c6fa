"""The native paged attention kernel with a draft tree's bits (`tree_bits`) against a dense
masked reference, in every variant this CPU runs: chains, bushy and deep trees, float32 and
bfloat16, contexts crossing blocks and range splits."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import attention_ops
from engine.model import attention
from engine.model.attention import RequestSpan

pytestmark = pytest.mark.skipif(
    not attention_ops.loaded(), reason="native kernels not built on this host"
)

# (isa argument, the CPU flag it needs, the cache dtypes it takes, block sizes it takes)
VARIANTS = {
    "scalar": (None, (torch.float32, torch.bfloat16), None),
    "avx2": ("avx2", (torch.float32, torch.bfloat16), None),
    "avx512": ("avx512", (torch.float32, torch.bfloat16), None),
    "avx512bf16": ("avx512bf16", (torch.bfloat16,), None),
    "amx": ("amxbf16", (torch.bfloat16,), 16),
}
# parents of each draft (-1: the known token before them), in node order
TREES = {
    "chain": (-1, 0, 1, 2, 3, 4),
    "bushy": (-1, -1, -1, -1, 0, 0, 1, 1),
    "deep": (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13),
    "two_branches": (-1, 0, 1, -1, 3, 4),
    "mixed": (-1, 0, 0, 2, -1, 4, 5, 4, 1, 8),
}


def _isa(isa: str, dtype: torch.dtype, block_size: int) -> str:
    """`isa` where this CPU and the case allow it; otherwise the test skips with the reason."""
    flag, dtypes, blocks = VARIANTS[isa]
    if flag is not None and not torch.ops.specserve_kernels.cpu_supports(flag):
        pytest.skip(f"this CPU lacks {flag}")
    if dtype not in dtypes:
        pytest.skip(f"{isa} takes bfloat16 caches only")
    if blocks is not None and block_size != blocks:
        pytest.skip(f"{isa} takes blocks of {blocks} only")
    return isa


def tree_bits(parents: tuple[int, ...]) -> list[int]:
    """Bits of the pass's rows (the known token, then the drafts): ancestors and itself."""
    bits = [1]
    for i, p in enumerate(parents):
        bits.append((bits[p + 1] if p >= 0 else 1) | 1 << (i + 1))
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # as int64


def _case(dtype: torch.dtype, block_size: int, dim: int, starts: list[int], trees: list[str]):  # type: ignore[no-untyped-def]
    """A pool, one request per (start, tree) with its blocks shuffled, q, and the bits."""
    g = torch.Generator().manual_seed(len(starts) * 100 + dim)
    kv_heads, ratio = 2, 3
    spans, bits = [], []
    ids = torch.randperm(200, generator=g).tolist()
    for start, tree in zip(starts, trees, strict=True):
        n = len(TREES[tree]) + 1 if tree != "none" else 1
        need = -(-(start + n) // block_size)
        spans.append(RequestSpan(start, n, ids[:need]))
        ids = ids[need:]
        bits += tree_bits(TREES[tree]) if tree != "none" else [1]
    shape = (kv_heads, 200, block_size, dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(bits), kv_heads * ratio, dim, generator=g).to(dtype)
    return spans, k, v, q, torch.tensor(bits, dtype=torch.int64)


def _kernel(spans, k, v, q, bits, isa, split_tokens):  # type: ignore[no-untyped-def]
    block_size = k.shape[2]
    tables = torch.zeros(len(spans), max(len(s.block_table) for s in spans), dtype=torch.int64)
    for b, s in enumerate(spans):
        tables[b, : len(s.block_table)] = torch.tensor(s.block_table)
    start = torch.tensor([s.start_pos for s in spans])
    qlen = torch.tensor([s.num_tokens for s in spans])
    assert tables.shape[1] * block_size >= max(s.context_len for s in spans)
    return attention_ops.paged_attention(
        q, k, v, tables, start, qlen, q.shape[-1] ** -0.5, isa=isa, split_tokens=split_tokens,
        tree_bits=bits,
    )  # fmt: skip


def _reference(spans, k, v, q, bits):  # type: ignore[no-untyped-def]
    """Dense float64: each row's scores over its request's whole context (rounded to the cache
    dtype as the kernel's are), the keys it does not see at -inf, softmax, values."""
    block_size, group = k.shape[2], q.shape[1] // k.shape[0]
    out, row = [], 0
    for s in spans:
        slots = [
            s.block_table[p // block_size] * block_size + p % block_size
            for p in range(s.context_len)
        ]
        keys = k.flatten(1, 2)[:, slots].double().repeat_interleave(group, 0)  # [heads, L, dim]
        values = v.flatten(1, 2)[:, slots].double().repeat_interleave(group, 0)
        for j in range(s.num_tokens):
            b = int(bits[row + j]) & (1 << 64) - 1
            seen = [
                p < s.start_pos or (b >> (p - s.start_pos)) & 1 == 1 for p in range(s.context_len)
            ]
            dots = torch.einsum("hd,hkd->hk", q[row + j].double(), keys)
            scores = dots.to(q.dtype).double() * q.shape[-1] ** -0.5
            scores = scores.masked_fill(~torch.tensor(seen), float("-inf")).softmax(-1)
            out.append(torch.einsum("hk,hkd->hd", scores, values))
        row += s.num_tokens
    return torch.stack(out).to(q.dtype)


@pytest.mark.parametrize("isa", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("dim", [32, 64, 80, 128])
@pytest.mark.parametrize("block_size", [4, 16])
def test_tree_bits_match_the_dense_reference(
    isa: str, dtype: torch.dtype, dim: int, block_size: int
) -> None:
    """A batch of every tree shape (and a plain decode) at starts that put the drafts across
    block boundaries and, with ranges of 32 tokens, across range splits."""
    isa = _isa(isa, dtype, block_size)
    if dim == 80 and isa in ("avx512bf16", "amx"):
        pytest.skip(f"{isa} has no head_dim 80 kernel")
    trees = list(TREES) + ["none"]
    starts = [29, 0, 45, 13, 90, 7]
    spans, k, v, q, bits = _case(dtype, block_size, dim, starts, trees)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for split in (32, 256):
        out = _kernel(spans, k, v, q, bits, isa, split)
        ref = _reference(spans, k, v, q, bits)
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("isa", list(VARIANTS))
def test_chain_bits_are_the_causal_kernel_bit_for_bit(isa: str) -> None:
    """A chain's bits (0..j for row j) hide nothing the causal limit does not: the same result
    exactly as without bits, so a chain verify is unchanged whichever way it is passed."""
    dtype = torch.bfloat16 if isa in ("avx512bf16", "amx") else torch.float32
    isa = _isa(isa, dtype, 16)
    spans, k, v, q, bits = _case(dtype, 16, 64, [29, 250, 3], ["chain", "deep", "none"])
    deep_as_chain = tree_bits(TREES["deep"])
    assert deep_as_chain == [(1 << (j + 1)) - 1 for j in range(16)]  # a chain of 15 drafts
    causal = _kernel(spans, k, v, q, None, isa, 64)
    assert torch.equal(_kernel(spans, k, v, q, bits, isa, 64), causal)


@pytest.mark.parametrize("isa", list(VARIANTS))
def test_every_variant_gives_the_scalar_references_result(isa: str) -> None:
    """float32 (and bfloat16 for the bf16 kernels): each variant close to the scalar kernel on
    a bushy tree, with the same rows hidden (a hidden key moving the result would show)."""
    dtype = torch.bfloat16 if isa in ("avx512bf16", "amx") else torch.float32
    isa = _isa(isa, dtype, 16)
    spans, k, v, q, bits = _case(dtype, 16, 128, [31, 17], ["bushy", "mixed"])
    out = _kernel(spans, k, v, q, bits, isa, 32)
    scalar = _kernel(spans, k, v, q, bits, "scalar", 32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), scalar.float(), rtol=tol, atol=tol)
    assert not torch.allclose(out.float(), _kernel(spans, k, v, q, None, isa, 32).float())


def test_sixty_four_tokens_a_pass_and_no_more() -> None:
    """Bit 63 (int64's sign) is the pass's 64th token; a 65-token pass with bits is refused."""
    parents = (-1, *range(61), -1)  # a chain of 62, then a sibling of the first draft at bit 63
    _, k, v, _, _ = _case(torch.float32, 16, 32, [5], ["none"])
    spans = [RequestSpan(5, 64, list(range(5)))]
    bits = torch.tensor(tree_bits(parents), dtype=torch.int64)
    assert int(bits[63]) < 0  # bits 0 and 63
    q = torch.randn(64, 6, 32)
    out = _kernel(spans, k, v, q, bits, "scalar", 256)
    torch.testing.assert_close(out, _reference(spans, k, v, q, bits), rtol=1e-5, atol=1e-5)
    spans = [RequestSpan(5, 65, list(range(5)))]
    with pytest.raises(RuntimeError, match="64 tokens"):
        _kernel(spans, k, v, torch.randn(65, 6, 32), torch.zeros(65, dtype=torch.int64),
                "scalar", 256)  # fmt: skip


def test_tree_groups_carry_their_bits_to_the_kernel() -> None:
    """attention.py's group: a tree's span gets its tree mask's bits, a chain's beside it the
    causal ones; the native kernel applies, with the gathered path's mask kept for the fallback."""
    parents = TREES["mixed"]
    n = len(parents) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    for j, b in enumerate(tree_bits(parents)):
        mask[j] = torch.tensor([(b >> i) & 1 == 1 for i in range(n)])
    spans = [
        RequestSpan(20, n, [0, 1], mask),
        RequestSpan(7, 3, [2]),
        RequestSpan(12, n, [3, 4], mask),
    ]
    meta = attention.AttentionMetadata.build(spans, 16, torch.device("cpu"))
    (group,) = meta.groups
    assert group.start_pos is not None and group.tree_bits is not None and group.mask is not None
    expected = tree_bits(parents) + [1, 3, 7] + tree_bits(parents)
    assert group.tree_bits.tolist() == expected
