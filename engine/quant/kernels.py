"""Kernels for one quantized weight: pack at load (the int4 layout depends on the CPU's ISA, so
packed weights are never cached on disk) and multiply per call.

Every kernel computes the weights its `QuantizedWeight` describes; `DenseKernel` is the
reference (dequantized once into the activation dtype) and the fallback. Which kernel a weight
gets is decided once at load by `make_kernel`; a kernel that fails its start-up self-test or
lacks its op falls back to `DenseKernel` with one log line per kind.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.quant.formats import INT4_GROUP_SIZES, Int4Weight, Int8Weight, QuantizedWeight

log = logging.getLogger("specserve.quant")

# Relative error a kernel may show against F.linear on its own dequantized weights (bf16
# activations and outputs round at ~4e-3).
SELF_TEST_TOLERANCE = 2e-2
_SELF_TEST_ROWS = 64
_checked: dict[tuple[str, str], bool] = {}  # (kernel name, device type) -> passed


class Kernel(Protocol):
    name: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # [M, K] -> [M, N]

    def tensors(self) -> list[torch.Tensor]: ...


class DenseKernel:
    """F.linear on the weights dequantized once into the activation dtype."""

    name = "dense"

    def __init__(
        self, weight: QuantizedWeight | torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> None:
        dense = weight if isinstance(weight, torch.Tensor) else weight.dequantize(torch.float32)
        self.weight = dense.to(device=device, dtype=dtype)  # [N, K]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


class Int4CpuKernel:
    """aten's int4 CPU GEMM (bf16 activations): w = (q - 8) * scale + zero per group."""

    name = "int4-cpu"

    def __init__(self, weight: Int4Weight, device: torch.device) -> None:
        self.group_size = weight.group_size
        # Packing is row-blocked (32 or 64 rows by ISA): slices of 1024 rows pack alike, and the
        # int32 copy the op wants never spans a whole vocabulary-sized matrix.
        self.packed = torch.cat(
            [
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(rows.to(torch.int32), 1)
                for rows in weight.q.split(1024)
            ]
        )
        self.scale_zero = _scale_zero(weight)  # [K / group, N, 2] bf16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        return _int4_cpu_mm(x, self.packed, self.group_size, self.scale_zero)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale_zero]


class Int4CudaKernel:
    """aten's tinygemm int4 kernel on CUDA (bf16 activations); same weights as on CPU."""

    name = "int4-cuda"

    def __init__(self, weight: Int4Weight, device: torch.device) -> None:
        self.group_size = weight.group_size
        q = weight.q.to(device)
        nibbles = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()  # [N, K / 2] uint8
        inner_k_tiles = 8 if weight.shape[1] % 1024 == 0 else 2
        self.packed = torch.ops.aten._convert_weight_to_int4pack(nibbles, inner_k_tiles)
        self.scale_zero = _scale_zero(weight).to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scale_zero)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scale_zero]


class Int8Kernel:
    """aten's int8 weight-only GEMM (bf16 activations, one scale per output row)."""

    name = "int8"

    def __init__(self, weight: Int8Weight, device: torch.device) -> None:
        self.q = weight.q.to(device).contiguous()  # [N, K] int8
        self.scale = weight.scale.to(device)  # [N] bf16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # The op reads past misaligned rows: hand it a fresh contiguous tensor of its own.
        x = x.to(torch.bfloat16, copy=True, memory_format=torch.contiguous_format)
        return torch.ops.aten._weight_int8pack_mm(x, self.q, self.scale)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


def _int4_cpu_mm(
    x: torch.Tensor,  # [M, K] bf16, contiguous
    packed: torch.Tensor,  # the ISA's packed layout of [N, K] 4-bit values
    group_size: int,
    scale_zero: torch.Tensor,  # [K / group_size, N, 2] bf16
) -> torch.Tensor:  # [M, N] bf16
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_zero)


def _scale_zero(weight: Int4Weight) -> torch.Tensor:  # [K / group, N, 2] bf16
    return torch.stack([weight.scale, weight.zero], dim=-1).transpose(0, 1).contiguous()


def make_kernel(
    weight: QuantizedWeight | torch.Tensor, dtype: torch.dtype, device: torch.device
) -> Kernel:
    """The fastest kernel for `weight` that passed its self-test here, else `DenseKernel`."""
    if isinstance(weight, torch.Tensor):
        return DenseKernel(weight, dtype, device)
    kind = _kernel_class(weight, dtype, device)
    if kind is None:
        return DenseKernel(weight, dtype, device)
    key = (kind.name, device.type)
    if key not in _checked:
        _checked[key] = _self_test(kind, weight, device)
    if not _checked[key]:
        return DenseKernel(weight, dtype, device)
    try:
        return kind(weight, device)  # type: ignore[arg-type]
    except (RuntimeError, NotImplementedError) as err:
        _fail(kind.name, f"{type(err).__name__}: {err}")
        _checked[key] = False
        return DenseKernel(weight, dtype, device)


def _kernel_class(
    weight: QuantizedWeight, dtype: torch.dtype, device: torch.device
) -> type[Int4CpuKernel] | type[Int4CudaKernel] | type[Int8Kernel] | None:
    """None where only the reference fits: float32 activations (exactness tests), odd shapes."""
    if dtype != torch.bfloat16:
        return None
    n, k = weight.shape
    if isinstance(weight, Int4Weight):
        if weight.group_size not in INT4_GROUP_SIZES or n % 16 or k % weight.group_size:
            return None
        return Int4CudaKernel if device.type == "cuda" else Int4CpuKernel
    if k % 16 or device.type not in ("cpu", "cuda"):
        return None  # the int8 op crashes on K not a multiple of 16
    return Int8Kernel


def _self_test(
    kind: type[Int4CpuKernel] | type[Int4CudaKernel] | type[Int8Kernel],
    weight: QuantizedWeight,
    device: torch.device,
) -> bool:
    """Run the kernel on the first rows of a real weight against F.linear on the same values."""
    rows = weight.rows(torch.arange(min(_SELF_TEST_ROWS, weight.shape[0])))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[1], generator=gen).to(device=device, dtype=torch.bfloat16)
    try:
        got = kind(rows, device)(x).float()  # type: ignore[arg-type]
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        return _fail(kind.name, f"{type(err).__name__}: {err}")
    want = F.linear(x.float(), rows.dequantize(torch.float32).to(device))
    err = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
    if not err <= SELF_TEST_TOLERANCE:
        return _fail(kind.name, f"relative error {err:.2e} > {SELF_TEST_TOLERANCE:.0e}")
    return True


def _fail(name: str, why: str) -> bool:
    log.warning(
        "quantized kernel %s failed its self-test (%s): those layers run dequantized bf16",
        name,
        why,
    )
    return False
