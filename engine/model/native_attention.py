"""Short-query attention through the native paged kernel (engine/kernels/csrc/attention.cpp).

Decodes and verify queries (up to SHORT_QUERY_MAX tokens a request) on the CPU read K and V in
place from the pool through the block tables, instead of gathering every request's context into
a padded copy per layer (engine.model.attention's `_gather`). Used when the native library loads
and offers the op, for float32 and bfloat16 caches; `SPECSERVE_NATIVE_ATTENTION=0` turns it off,
and everything else (prompt chunks, other devices, float16, compiled graphs) keeps the gathered
path.
"""

from __future__ import annotations

import os
from functools import cache

import torch

_DTYPES = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    return os.environ.get("SPECSERVE_NATIVE_ATTENTION", "1") not in ("0", "false", "off")


@cache
def available() -> bool:
    """The library is built and loaded and registers `paged_attention` (probed once)."""
    if not enabled():
        return False
    from engine.kernels import build

    return build.load() and hasattr(torch.ops.specserve_kernels, "paged_attention")


def usable(q: torch.Tensor) -> bool:
    # torch.compile cannot trace the op (no fake kernel): compiled graphs keep the gathered path
    return (
        q.device.type == "cpu"
        and q.dtype in _DTYPES
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
    isa: str = "auto",  # "scalar" or "avx512" to pin a variant (tests)
    min_split_tokens: int = 256,  # a request's context is split into ranges no shorter
) -> torch.Tensor:  # [tokens, heads, head_dim]
    return torch.ops.specserve_kernels.paged_attention(
        q.contiguous(), k_cache, v_cache, block_tables, start_pos, query_lens, scale, isa,
        min_split_tokens,
    )  # fmt: skip
