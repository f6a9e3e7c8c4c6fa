"""Quantized stand-ins for the decoder's nn.Linear and nn.Embedding, filled shard by shard at load.

A fused layer (q/k/v, gate/up) may get shards in different formats (a GGUF keeps some v_proj
in Q6_K next to Q4_K q/k): consecutive shards of one format share a kernel, and the outputs are
concatenated. Kernels are chosen once at load, not per call: measured on the 2-core AVX2 host
(bench numbers in docs/BENCHMARKS.md), the int4 and int8 kernels beat bf16 F.linear at every
row count up to 512, so there is no per-M switch to a dequantized GEMM.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from engine.model.quant.formats import (
    GgufBlocks,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    cat_rows,
    quantize_int4,
    quantize_int8,
    same_format,
)
from engine.model.quant.gguf_weights import GgufRows
from engine.model.quant.kernels import DenseKernel, Int8DynamicKernel, Kernel, make_kernel

# "keep": quantized tensors stay as they come, float ones stay dense (GGUF files);
# "int4" / "int8": float tensors are rounded to nearest at load;
# "w8a8" / "w8a8-fast": every matrix becomes int8 per row (int4 blocks re-rounded), run with
# activations rounded to int8 per row in two passes (value and residual) or one;
# "gguf": as "keep", the file's blocks arriving as `GgufBlocks` for the native kernels.
QuantizeMode = Literal["keep", "int4", "int8", "w8a8", "w8a8-fast", "gguf"]
ACTIVATION_PASSES: dict[str, int] = {"w8a8": 2, "w8a8-fast": 1}
Shard = torch.Tensor | QuantizedWeight | GgufRows


def to_format(value: Shard, mode: QuantizeMode) -> Shard:
    """Float tensors rounded as `mode` says; quantized weights and GGUF rows stay as they are,
    except that w8a8 re-rounds every matrix to int8."""
    if mode in ACTIVATION_PASSES:
        if isinstance(value, GgufRows | Int8Weight):
            return value
        if isinstance(value, torch.Tensor):
            return quantize_int8(value)
        return quantize_int8(value.dequantize(torch.float32), source=value.source)
    if not isinstance(value, torch.Tensor) or mode in ("keep", "gguf"):
        return value
    if mode == "int4" and value.shape[1] % 32 == 0:
        return quantize_int4(value, 32)
    return quantize_int8(value)


class QuantLinear(nn.Module):
    """y = x W^T (+ bias), W held in one or more quantized row blocks."""

    def __init__(
        self,
        shard_sizes: list[int],
        in_features: int,
        bias: bool,
        mode: QuantizeMode,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.shard_sizes = shard_sizes
        self.in_features = in_features
        self.out_features = sum(shard_sizes)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.mode = mode
        self.dtype = dtype
        self.device = device
        self.kernels: list[Kernel] = []
        self.formats: list[str] = []
        self._shards: dict[int, Shard] = {}
        # what the kernels read without a cast: float32 for GGUF blocks (set at load)
        self.input_dtype = dtype

    def load_shard(self, shard: int, value: Shard) -> None:
        if tuple(value.shape) != (self.shard_sizes[shard], self.in_features):
            raise ValueError(f"shard {shard}: shape {tuple(value.shape)} does not fit")
        self._shards[shard] = to_format(value, self.mode)
        if len(self._shards) == len(self.shard_sizes):
            self._build([self._shards[i] for i in range(len(self.shard_sizes))])
            self._shards = {}

    def _build(self, shards: list[Shard]) -> None:
        passes = ACTIVATION_PASSES.get(self.mode, 0)
        for run in _runs_of_one_format(shards):
            weight = torch.cat(run) if isinstance(run[0], torch.Tensor) else cat_rows(run)  # type: ignore[arg-type]
            kernel = make_kernel(weight, self.dtype, self.device, passes)
            self.kernels.append(kernel)
            self.formats.append(format_name(weight, kernel, self.dtype))
        if all(kernel.name == "gguf" for kernel in self.kernels):
            self.input_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out] in the model dtype
        y = self._products(x).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def unrounded(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        """The kernels' output before rounding to the model dtype: float32 from the GGUF
        kernels, which a fused op after them rounds itself (decoder.silu_mul)."""
        if self.bias is not None:
            raise ValueError("unrounded() is for layers without a bias")
        return self._products(x)

    def _products(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out], kernels' dtype
        if not self.kernels:
            raise RuntimeError("quantized layer used before its weights were loaded")
        ys = [kernel(x) for kernel in self.kernels]
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


class QuantEmbedding(nn.Module):
    """Embedding rows gathered from a quantized table and dequantized on the fly.

    Int4 rows are held two per byte; for a tied head, `attend` runs the table as a linear layer
    through its own kernel (int8 shares the table's bytes; int4 packs a second copy).
    """

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        tied: bool,
        mode: QuantizeMode,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.shape = (num_embeddings, dim)
        self.tied = tied
        self.mode = mode
        self.dtype = dtype
        self.device = device
        self.table: _Table | None = None
        self.head: Kernel | None = None
        self.format = ""

    def load_shard(self, shard: int, value: Shard) -> None:
        if shard != 0 or tuple(value.shape) != self.shape:
            raise ValueError(f"embedding shape {tuple(value.shape)} != {self.shape}")
        value = to_format(value, self.mode)
        self.table = _Table(value, self.dtype, self.device)
        if isinstance(value, GgufRows):  # only untied tables are left in the file
            self.format = f"{value.kind.name} rows from the file"
            return
        passes = ACTIVATION_PASSES.get(self.mode, 0)
        self.head = make_kernel(value, self.dtype, self.device, passes) if self.tied else None
        self.format = format_name(value, self.head, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        if self.table is None:
            raise RuntimeError("quantized embedding used before its weights were loaded")
        return self.table.rows(ids)

    def attend(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, dim] -> [N, vocab]
        if self.head is None:
            raise RuntimeError("the embedding is not a tied head")
        return self.head(hidden)

    def tensors(self) -> list[torch.Tensor]:
        table = self.table.tensors() if self.table is not None else []
        return table + (self.head.tensors() if self.head is not None else [])


class _Table:
    """The embedding table in its compact form; `rows` dequantizes only the rows asked for."""

    def __init__(self, value: Shard, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.dense: torch.Tensor | None = None
        self.int8: Int8Weight | None = None
        self.int4: Int4Weight | None = None
        self.gguf: GgufRows | None = None
        self.blocks: GgufBlocks | None = None  # shared with a tied head's kernel
        if isinstance(value, GgufRows):
            self.gguf = value
        elif isinstance(value, GgufBlocks):
            self.blocks = value
        elif isinstance(value, torch.Tensor):
            self.dense = value.to(device=device, dtype=dtype)
        elif isinstance(value, Int8Weight):
            self.int8 = Int8Weight(value.q.to(device), value.scale.to(device), value.source)
        else:
            q = value.q.to(device)
            nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # [V, K / 2]: two values per byte
            self.int4 = Int4Weight(
                nibbles,
                value.scale.to(device),
                value.zero.to(device),
                value.group_size,
                value.source,
            )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, K]
        if self.gguf is not None:
            return self.gguf.rows(ids).to(device=self.device, dtype=self.dtype)
        if self.blocks is not None:
            return self.blocks.rows(ids.cpu()).dequantize(self.dtype).to(self.device)
        if self.dense is not None:
            return self.dense[ids]
        if self.int8 is not None:
            return self.int8.rows(ids).dequantize(self.dtype)
        assert self.int4 is not None
        packed = self.int4.rows(ids)
        q = torch.stack([packed.q & 0x0F, packed.q >> 4], dim=-1).flatten(1)  # [T, K]
        return Int4Weight(q, packed.scale, packed.zero, packed.group_size).dequantize(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        if self.gguf is not None:
            return []  # memory-mapped: only the rows read lately are resident
        if self.blocks is not None:
            return [self.blocks.blocks]
        if self.dense is not None:
            return [self.dense]
        if self.int8 is not None:
            return [self.int8.q, self.int8.scale]
        assert self.int4 is not None
        return [self.int4.q, self.int4.scale, self.int4.zero]


def _runs_of_one_format(shards: list[Shard]) -> list[list[Shard]]:
    runs: list[list[Shard]] = []
    for shard in shards:
        if runs and same_format(runs[-1][-1], shard):
            runs[-1].append(shard)
        else:
            runs.append([shard])
    return runs


def format_name(
    weight: torch.Tensor | QuantizedWeight, kernel: Kernel | None, dtype: torch.dtype
) -> str:
    """ "int4-g32", "int8", "w8a8", "bf16"; a quantized weight run dequantized says so."""
    dense = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16")
    if isinstance(weight, torch.Tensor):
        return dense
    if isinstance(kernel, Int8DynamicKernel):
        return kernel.name.removesuffix("-cpu")  # int8 weights and activations
    return f"{weight.kind}->{dense}" if isinstance(kernel, DenseKernel) else weight.kind
