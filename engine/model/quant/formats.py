"""Quantized weight formats: what a quantized matrix holds, independent of any kernel.

`Int4Weight` is asymmetric 4-bit with one (scale, zero) pair per group of `group_size` inputs,
in the form the int4 kernels compute: w = (q - 8) * scale + zero. GGUF's Q4_K maps onto it
exactly at group size 32; `quantize_int4` rounds a float matrix to nearest (gpt-fast's scheme).
`Int8Weight` is symmetric 8-bit with one scale per output row: w = q * scale.

Scales and zeros are held in bfloat16, the kernels' own precision, so that the dequantized
reference and every kernel compute the same weights.
`GgufBlocks` is a matrix left in a GGUF file's own blocks (Q4_K, Q6_K, Q8_0, ...), byte for byte,
for the native kernels (`quantization: gguf`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kernels import gguf_ops

INT4_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Weight:
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K // group_size] bfloat16
    zero: torch.Tensor  # [N, K // group_size] bfloat16
    group_size: int
    source: str = "rtn"  # where the values came from: "rtn" or a GGUF type such as "Q4_K"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    @property
    def kind(self) -> str:
        return f"int4-g{self.group_size}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        n, k = self.shape
        q = self.q.view(n, k // self.group_size, self.group_size).float() - 8.0
        w = q * self.scale.float()[..., None] + self.zero.float()[..., None]
        return w.view(n, k).to(dtype)

    def rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(
            self.q[index], self.scale[index], self.zero[index], self.group_size, self.source
        )


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] bfloat16
    source: str = "rtn"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    @property
    def kind(self) -> str:
        return "int8"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        return (self.q.float() * self.scale.float()[:, None]).to(dtype)

    def rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.q[index], self.scale[index], self.source)


@dataclass(frozen=True)
class GgufBlocks:
    blocks: torch.Tensor  # [N, K / values per block * bytes per block] uint8, as in the file
    qtype: int  # GGML type id (gguf.GGMLQuantizationType)
    in_features: int
    source: str  # the type's name, e.g. "Q4_K"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.blocks.shape[0]), self.in_features

    @property
    def kind(self) -> str:
        return self.source

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        return gguf_ops.dequantize(self.blocks, self.qtype).to(dtype)

    def rows(self, index: torch.Tensor) -> GgufBlocks:
        return GgufBlocks(self.blocks[index], self.qtype, self.in_features, self.source)


QuantizedWeight = Int4Weight | Int8Weight | GgufBlocks


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Round to nearest, asymmetric per group: the group's [min, max] spans q = 0..15."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the group size {group_size}")
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    q = torch.round((g - zero.float()[..., None]) / scale.float()[..., None] + 8)
    return Int4Weight(q.clamp(0, 15).to(torch.uint8).view(n, k), scale, zero, group_size)


def quantize_int8(
    w: torch.Tensor, source: str = "rtn", scale_dtype: torch.dtype = torch.bfloat16
) -> Int8Weight:
    """Round to nearest, symmetric per output row (the scales stored in `scale_dtype`)."""
    w32 = w.float()
    scale = (w32.abs().amax(1) / 127).clamp(min=1e-10).to(scale_dtype)
    q = torch.round(w32 / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale, source)


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """Stack same-format weights along the output dimension (fused q/k/v, gate/up)."""
    first = parts[0]
    if isinstance(first, GgufBlocks):
        blocks = [p.blocks for p in parts if isinstance(p, GgufBlocks)]
        return GgufBlocks(torch.cat(blocks), first.qtype, first.in_features, first.source)
    if isinstance(first, Int4Weight):
        int4 = [p for p in parts if isinstance(p, Int4Weight)]
        return Int4Weight(
            torch.cat([p.q for p in int4]),
            torch.cat([p.scale for p in int4]),
            torch.cat([p.zero for p in int4]),
            first.group_size,
            first.source,
        )
    int8 = [p for p in parts if isinstance(p, Int8Weight)]
    return Int8Weight(
        torch.cat([p.q for p in int8]), torch.cat([p.scale for p in int8]), first.source
    )


def same_format(a: object, b: object) -> bool:
    if isinstance(a, Int4Weight) and isinstance(b, Int4Weight):
        return a.group_size == b.group_size
    if isinstance(a, GgufBlocks) and isinstance(b, GgufBlocks):
        return a.qtype == b.qtype
    return type(a) is type(b)
