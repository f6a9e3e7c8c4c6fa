"""The native kernel for a weight left in a GGUF file's own blocks (`quantization: gguf`).

Decode and verify rows go through `gguf_mm`: activations rounded to int8 per row, every weight
block unpacked once for all the rows, a row's result the same alone or in any batch. A prefill
chunk of many rows takes whichever path is faster on this CPU: the same kernel, or the dense
one: the blocks dequantized for the call (for a bf16 model straight to bf16 by the native
`gguf_dequantize_bf16`, ~17x faster than float32 then `.to`) and torch's GEMM (AMX or AVX512-BF16
where the CPU has them). The panel-tiled `gguf_mm_bf16`, which never holds a whole bf16 weight,
measured slower here once made batch-invariant (docs/KERNELS.md), so the transient copy stays. That row
count is measured once per process, on the first weight big enough to tell, at load, and logged;
it is never below the verify rows.

Which path a row takes is decided by its own request's chunk, never by the batch: the runner
names the forward's chunks (`forward_chunks`), and only the rows of a chunk at least that long
run dense. A decode or verify row therefore runs native whether it shares a step with a long
prompt or not, so speculative greedy output equals plain greedy output.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from engine.kernels import gguf_ops, memory
from engine.model.quant.formats import GgufBlocks

log = logging.getLogger("specserve.quant")

# Activations are rounded to int8 once, per group of 16 values (csrc/gguf_blocks.h): on the
# bundled 1.5B, 98.5% greedy top-1 agreement with its float32 dequantized weights and +0.4%
# perplexity over 2,008 positions, where one scale per 256 values (llama.cpp's q8_K) gave 97.0% /
# +4.3%. A second pass (what the first rounding left, rounded again) would double the integer
# work of every row: a 4-row verify then cost as much as 8 rows (docs/KERNELS.md).
ACTIVATION_PASSES = 1

# Row counts tried for the dense prefill path, smallest first; verify rows (<= 16) stay native.
PREFILL_CANDIDATES = (32, 128, 512)
_MEASURE_MIN_VALUES = 1 << 20  # weights smaller than this time too noisily to decide on
NEVER = sys.maxsize
_dense_from: dict[torch.dtype, int] = {}  # by dense dtype: rows from which the dense path runs
# The layout weights are packed into at load ("": the fastest here; "tiles" / "rows16": see
# gguf_ops.pack). Only benchmarks comparing layouts in one process set it.
pack_layout = ""


class GgufKernel:
    """y = x W^T with W the file's blocks; float32 out, except bf16 from the bf16 dense path
    (the layer's own dtype: a float32 round trip would only add two copies of the output)."""

    name = "gguf"

    def __init__(self, weight: GgufBlocks, dtype: torch.dtype) -> None:
        # [N, bytes per row] uint8, repacked for this CPU's kernel where that pays (Q4_K)
        self.blocks, self.qtype = gguf_ops.pack(
            weight.blocks.contiguous(), weight.qtype, layout=pack_layout
        )
        self.dense_dtype = _dense_dtype(dtype)
        if (
            self.dense_dtype not in _dense_from
            and weight.blocks.shape[0] * weight.in_features >= _MEASURE_MIN_VALUES
        ):
            _dense_from[self.dense_dtype] = _measure_dense_from(self, weight.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        dense_from = _dense_from.get(self.dense_dtype, NEVER)
        if x.shape[0] < dense_from:  # no chunk can be long enough
            return self.native(x)
        native_rows = _native_rows(x.shape[0], dense_from)
        if native_rows is None:
            return self.dense(x)
        if native_rows.numel() == x.shape[0]:
            return self.native(x)
        # the few short rows computed twice: cheaper than splitting the call; float32, so that a
        # native row (a logits row of the head too) is what it is alone
        out = self.dense(x).float()
        out[native_rows] = self.native(x[native_rows])
        return out

    def native(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_ops.mm(
            x.float().contiguous(), self.blocks, self.qtype, passes=ACTIVATION_PASSES
        )

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_dtype == torch.bfloat16 and gguf_ops.has_prefill_ops():
            w = gguf_ops.dequantize_bf16(self.blocks, self.qtype)  # [N, K], freed after the call
            return F.linear(x.to(torch.bfloat16), w)
        w = gguf_ops.dequantize(self.blocks, self.qtype).to(self.dense_dtype)  # [N, K]
        return F.linear(x.to(self.dense_dtype), w).float()

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]


def pack_on_huge_pages(kernels: list[GgufKernel]) -> None:
    """Every kernel's blocks moved into one buffer on 2 MB pages (memory.empty_huge). Apart, each
    matrix under 4 MB (the advice's minimum: attention projections, a MoE's 1-2 MB experts) sits
    on 4 KB pages, and a decode step streaming them takes a TLB miss every 4 KB. Loaded with
    their blocks apart, the bundled 1.5B had 0.66 of its 1.35 GB on huge pages, the 8-layer
    Qwen3-30B-A3B-shaped bench file 0.3 of 3.4 GB."""
    if not kernels:
        return
    sizes = [-(-k.blocks.numel() // _ALIGN) * _ALIGN for k in kernels]  # views 64-byte aligned
    buffer = memory.empty_huge((sum(sizes),), torch.uint8)
    offset = 0
    for kernel, size in zip(kernels, sizes, strict=True):
        view = buffer[offset : offset + kernel.blocks.numel()].view(kernel.blocks.shape)
        view.copy_(kernel.blocks)
        kernel.blocks = view  # the old tensor is freed
        offset += size


_ALIGN = 64


def _dense_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def native_chunk_limit(dtype: torch.dtype) -> int:
    """A model in `dtype` runs every chunk shorter than this on the native kernel; a longer one
    may run dense."""
    return _dense_from.get(_dense_dtype(dtype), NEVER)


_forward = threading.local()  # the chunks of the forward running on this thread


@contextmanager
def forward_chunks(lengths: list[int]) -> Iterator[None]:
    """The forward run inside: its requests' new-token counts, in row order."""
    _forward.lengths, _forward.rows = lengths, {}
    try:
        yield
    finally:
        _forward.lengths, _forward.rows = None, {}


def _native_rows(num_rows: int, dense_from: int) -> torch.Tensor | None:
    """[R] int64: the rows of a call that must run native (chunks shorter than dense_from); None:
    every row may run dense (a call outside any named forward, as in a benchmark). A call whose
    rows are not the forward's tokens (the logits of some of them) runs native throughout."""
    lengths = getattr(_forward, "lengths", None)
    if lengths is None:
        return None
    if num_rows != sum(lengths):
        return torch.arange(num_rows)
    cached = _forward.rows.get(dense_from)
    if cached is None:
        short = [torch.arange(n) + start for start, n in _starts(lengths) if n < dense_from]
        cached = torch.cat(short) if short else torch.empty(0, dtype=torch.int64)
        _forward.rows[dense_from] = cached
    return cached


def _starts(lengths: list[int]) -> Iterator[tuple[int, int]]:
    start = 0
    for n in lengths:
        yield start, n
        start += n


def _measure_dense_from(kernel: GgufKernel, in_features: int) -> int:
    """The smallest candidate row count at which the dense path beat the native one here."""
    gen = torch.Generator().manual_seed(0)
    timings = []
    for rows in PREFILL_CANDIDATES:
        x = torch.randn(rows, in_features, generator=gen)
        native, dense = _best_ms(kernel.native, x), _best_ms(kernel.dense, x)
        timings.append(f"{rows} rows: native {native:.1f} ms, dense {dense:.1f} ms")
        if dense < native:
            log.info(
                "gguf kernels (%s): prefill chunks of >= %d rows run dequantized %s GEMM (%s)",
                gguf_ops.variants()[0],
                rows,
                kernel.dense_dtype,
                "; ".join(timings),
            )
            return rows
    log.info(
        "gguf kernels (%s): every row count runs native (%s)",
        gguf_ops.variants()[0],
        "; ".join(timings),
    )
    return NEVER


def _best_ms(fn: object, x: torch.Tensor, repeats: int = 2) -> float:
    assert callable(fn)
    fn(x)  # warm: pages, caches, the thread pool
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - started)
    return best * 1000
