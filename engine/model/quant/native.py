"""The native kernel for a weight left in a GGUF file's own blocks (`quantization: gguf`).

Decode and verify rows go through `gguf_mm`: activations rounded to int8 per row, every weight
block unpacked once for all the rows, a row's result the same alone or in any batch. A prefill
chunk of many rows takes whichever path is faster on this CPU: the same kernel, or the dense
one: for a bf16 model `gguf_mm_bf16` (panels of weight rows dequantized to bf16 in a cache-sized
buffer and multiplied by torch's bf16 GEMM, AMX or AVX512-BF16 where the CPU has them; no full
bf16 copy of a weight exists), for a float32 model the blocks dequantized for the call. That count is measured once per process, on the first weight big enough to
tell, at load, and logged; it is never below the verify rows, so batch invariance holds where
speculation needs it.
"""

from __future__ import annotations

import logging
import sys
import time

import torch
import torch.nn.functional as F

from engine.kernels import gguf_ops
from engine.model.quant.formats import GgufBlocks

log = logging.getLogger("specserve.quant")

# Row counts tried for the dense prefill path, smallest first; verify rows (<= 16) stay native.
PREFILL_CANDIDATES = (32, 128, 512)
_MEASURE_MIN_VALUES = 1 << 20  # weights smaller than this time too noisily to decide on
NEVER = sys.maxsize
_dense_from: dict[torch.dtype, int] = {}  # by dense dtype: rows from which the dense path runs


class GgufKernel:
    """y = x W^T with W the file's blocks; float32 out, except bf16 from the bf16 prefill GEMM
    (the layer's own dtype: a float32 round trip would only add two copies of the output)."""

    name = "gguf"

    def __init__(self, weight: GgufBlocks, dtype: torch.dtype) -> None:
        # [N, bytes per row] uint8, repacked for this CPU's kernel where that pays (Q4_K)
        self.blocks, self.qtype = gguf_ops.pack(weight.blocks.contiguous(), weight.qtype)
        self.dense_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        if (
            self.dense_dtype not in _dense_from
            and weight.blocks.shape[0] * weight.in_features >= _MEASURE_MIN_VALUES
        ):
            _dense_from[self.dense_dtype] = _measure_dense_from(self, weight.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.shape[0] >= _dense_from.get(self.dense_dtype, NEVER):
            return self.dense(x)
        return self.native(x)

    def native(self, x: torch.Tensor) -> torch.Tensor:
        return gguf_ops.mm(x.float().contiguous(), self.blocks, self.qtype)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense_dtype == torch.bfloat16 and gguf_ops.has_prefill_ops():
            return gguf_ops.mm_bf16(x.to(torch.bfloat16).contiguous(), self.blocks, self.qtype)
        w = gguf_ops.dequantize(self.blocks, self.qtype).to(self.dense_dtype)  # [N, K]
        return F.linear(x.to(self.dense_dtype), w).float()

    def tensors(self) -> list[torch.Tensor]:
        return [self.blocks]


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


def native_gguf(from_gguf: bool) -> bool:
    """Whether `quantization: gguf` runs on the native kernels; else one log line says why and
    what runs instead."""
    if not from_gguf:
        log.warning(
            "quantization gguf: the model is not a .gguf file; its weights load as with auto"
        )
        return False
    if not gguf_ops.available():
        log.warning(
            "quantization gguf: the native kernels are not available here (see the line above); "
            "the file's blocks run on torch's int4/int8 kernels as with auto"
        )
        return False
    return True
