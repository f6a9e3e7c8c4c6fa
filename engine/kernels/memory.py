"""Large CPU buffers on 2 MB pages (engine/kernels/csrc/memory.h).

A decode step streams every weight and the whole KV cache once; on 4 KB pages each 4 KB of that
is a TLB miss. The packed GGUF weights get the advice inside `gguf_pack`; the KV pool, which
Python allocates, through `empty_huge`. The advice is a no-op where transparent huge pages are
off or the native library is not loaded.
"""

from __future__ import annotations

from functools import cache

import torch

from engine.kernels import build


@cache
def _advise_op() -> bool:
    return build.load() and "advise_huge_pages" in build.ops()


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty on the CPU, its pages advised huge before anything touches them."""
    t = torch.empty(shape, dtype=dtype)
    if _advise_op():
        torch.ops.specserve_kernels.advise_huge_pages(t)
    return t
