"""Short-query attention through the native paged kernel (engine/kernels/csrc/attention.cpp).

Decodes and verify queries (up to SHORT_QUERY_MAX tokens a request) on the CPU read K and V in
place from the pool through the block tables, instead of gathering every request's context into
a padded copy per layer (engine.model.attention's `_gather`). Used when the native library loads
and offers the op, for float32 and bfloat16 caches; `SPECSERVE_NATIVE_ATTENTION=0` turns it off,
and everything else (prompt chunks, other devices, float16, compiled graphs) keeps the gathered
path.

A row's result does not depend on the query it is part of (its length, its tile, the batch),
so a verify row equals the decode of its position bit for bit; with a sliding window too
(Gemma 3's local layers read only the blocks their window reaches). Prompt chunks stay on SDPA,
several times faster there (AMX / AVX512-BF16 GEMM tiles); drafts behind a prompt chunk are a
query of their own (engine.model.runner `_spans`), so no row changes kernel between plain and
speculative decoding.
"""

from __future__ import annotations

import os
from functools import cache

import torch

_DTYPES = (torch.float32, torch.bfloat16)
# head_dims the SIMD kernels are compiled for (`avx512_for`, `avx2_for`: csrc/attention_*); elsewhere,
# and on a CPU without AVX2, only the scalar reference would run: the gathered path is faster.
SIMD_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def enabled() -> bool:
    return os.environ.get("SPECSERVE_NATIVE_ATTENTION", "1") not in ("0", "false", "off")


@cache
def loaded() -> bool:
    """The native library is built and loaded and registers `paged_attention` (probed once)."""
    from engine.kernels import build

    return build.load() and hasattr(torch.ops.specserve_kernels, "paged_attention")


@cache
def available() -> bool:
    """The engine uses the kernel: enabled, loaded, and the CPU runs a SIMD variant of it."""
    if not (enabled() and loaded()):
        return False
    return any(torch.ops.specserve_kernels.cpu_supports(isa) for isa in ("avx512", "avx2"))


def usable(q: torch.Tensor) -> bool:
    # torch.compile cannot trace the op (no fake kernel): compiled graphs keep the gathered path
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
        and q.shape[-1] in SIMD_HEAD_DIMS
        and not torch.compiler.is_compiling()
        and available()
    )


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_dim], requests' tokens contiguous
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    v_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, head_dim]
    block_tables: torch.Tensor,  # [batch, max_blocks] int64
    start_pos: torch.Tensor,  # [batch] int64: tokens cached before this pass
    query_lens: torch.Tensor,  # [batch] int64: new tokens, summing to `tokens`
    scale: float,
    isa: str = "auto",  # "scalar", "avx2", "avx512", "avx512bf16" or "amx": pin a variant (tests)
    split_tokens: int = 256,  # a request's context is split into ranges of this many tokens
    window: int = 0,  # a sliding-window layer's: the query at p sees keys (p - window, p]; 0: all
    tree_bits: torch.Tensor | None = None,  # [tokens] int64: a draft tree's rows (below)
) -> torch.Tensor:  # [tokens, heads, head_dim]
    """With a window, request b's block table starts at its block
    max(0, start_pos[b] + 1 - window) // block_size (the first its first query sees).

    With `tree_bits`, query j of request b sees the cached keys and, of this pass's, the i-th
    (position start_pos[b] + i) only where bit i of its row's bits is set: a draft tree's verify,
    the nodes written in node order. A chain's rows are bits 0..j. At most 64 tokens a request."""
    out: torch.Tensor = torch.ops.specserve_kernels.paged_attention(
        q.contiguous(), k_cache, v_cache, block_tables, start_pos, query_lens, scale, isa,
        split_tokens, window, tree_bits,
    )  # fmt: skip
    return out
