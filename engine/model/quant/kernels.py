"""Kernels for one quantized weight: pack at load (the int4 layout depends on the CPU's ISA, so
packed weights are never cached on disk) and multiply per call.

Every kernel computes the weights its `QuantizedWeight` describes; `DenseKernel` is the
reference (dequantized once into the activation dtype) and the fallback. `Int8DynamicKernel`
also rounds its activations to int8 per row (`quantization: w8a8`), for fbgemm's int8 GEMM.
Which kernel a weight gets is decided once at load by `make_kernel`; a kernel that fails its
start-up self-test or lacks its op falls back to the next candidate (w8a8 to the weight-only
int8 kernel), then to `DenseKernel`, with one log line per kind.
"""

from __future__ import annotations

import itertools
import logging
import warnings
import weakref
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.model.quant.formats import (
    INT4_GROUP_SIZES,
    GgufBlocks,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
)
from engine.model.quant.native import GgufKernel

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


class Int8DynamicKernel:
    """fbgemm's int8 x int8 GEMM (`quantized::linear_dynamic`) on activations rounded per row.

    On CPUs without a native int4 GEMM (AVX2) it costs what int4 does at one row and grows far
    more slowly with rows, which makes verifying drafts and batching cheap (docs/BENCHMARKS.md).

    Batch invariance: fbgemm rounds its whole input with one scale, which would couple the rows
    of a batch. So each row is first put on a grid of its own (`_row_grid`): 128 levels across
    the row's [min, max], handed over as the integers g = q - 64. Every input then spans exactly
    [-64, 63], fbgemm picks scale 1 and zero point 64 whatever the batch, its integer products
    are exact, and a row's output is bit-identical alone or in any batch (the target's must be:
    a verify row has to equal the decode it stands for).

    Precision: 7 bits per row lose ~4% of greedy picks on the 1.5B (outlier channels stretch a
    row's range). With `passes = 2` the row's rounding residual (within half a step) is rounded
    again, on 126 levels per step, and goes through the same GEMM as extra rows (~14 bits),
    which keeps bf16's quality at twice the rows.
    """

    name = "w8a8-cpu"
    passes = 2
    tolerance = 4e-2  # what the self-test allows against bf16 F.linear

    def __init__(self, weight: Int8Weight, device: torch.device) -> None:
        n, k = weight.shape
        scale = weight.scale.double()  # [N]
        zeros = torch.zeros(n, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated: the self-test and
            warnings.simplefilter("ignore")  # the int8 fallback cover their removal
            q = torch._make_per_channel_quantized_tensor(weight.q, scale, zeros, 0)
        self.packed = torch.ops.quantized.linear_prepack(q, None)
        self.handle = _register_packed(self)  # how a compiled graph names the packed weight
        self.out_features = n
        self.row_sums = weight.dequantize(torch.float32).sum(1)  # [N]: W 1
        self.packed_bytes = n * k + 8 * n  # fbgemm's own copy: int8 values, a scale per row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N] float32
        m = x.shape[0]
        u, mid, step = _row_grid(x.float())  # x = mid + step * u: [M, K], [M, 1], [M, 1]
        if self.passes == 1:
            y = self._gemm(u.round_())  # [M, N]: W g
        else:
            g = u.round()
            residual = (u - g).mul_(_RESIDUAL_LEVELS).round_()  # in -63..63
            both = self._gemm(torch.cat([g, residual]))
            y = torch.add(both[:m], both[m:], alpha=1 / _RESIDUAL_LEVELS)  # W (g + residual / 126)
        return torch.addcmul(mid * self.row_sums, step, y)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] float32 -> [M, N] float32
        if torch.compiler.is_compiling():  # the packed weight is opaque to the compiler
            return torch.ops.specserve.linear_dynamic(x, self.handle, self.out_features)
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)

    def tensors(self) -> list[torch.Tensor]:  # the packed weight is not a tensor: packed_bytes
        return [self.row_sums]


class Int8DynamicFastKernel(Int8DynamicKernel):
    """One pass: 7-bit activations, the fastest kernel here, for a draft model.

    A single row (a draft's decode at low load, the common case) goes to fbgemm as it is: its
    own per-tensor rounding is then per-row, one op where the grid takes twelve (-10% of the
    0.5B draft's forward). Its grid includes zero, so a row rounds slightly differently alone
    than inside a batch: a draft's rows only move acceptance, never the output.
    """

    name = "w8a8-fast-cpu"
    passes = 1
    tolerance = 6e-2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N] float32
        if x.shape[0] == 1:
            return self._gemm(x.float())
        return super().__call__(x)


# fbgemm's packed weights by handle, for graphs compiled with torch.compile (ModelRunner's
# compiled decode): the compiler cannot trace a packed weight, so the graph holds a 0-d int64
# tensor naming it (a tensor, not an int, so that one graph serves every layer) and calls
# `specserve::linear_dynamic`, whose body looks the weight up. An entry lives as its kernel does.
_PACKED: dict[int, torch.ScriptObject] = {}
_next_handle = itertools.count()


def _register_packed(kernel: Int8DynamicKernel) -> torch.Tensor:
    handle = next(_next_handle)
    _PACKED[handle] = kernel.packed
    weakref.finalize(kernel, _PACKED.pop, handle, None)
    return torch.tensor(handle)


@torch.library.custom_op("specserve::linear_dynamic", mutates_args=())
def _linear_dynamic(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, _PACKED[int(handle)], True)


@_linear_dynamic.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_ACT_LEVELS = 127  # fbgemm's reduced range: u8 x s8 pairs cannot saturate on AVX2
_ACT_ZERO = 64
_RESIDUAL_LEVELS = 126  # a residual in [-1/2, 1/2] step, on levels -63..63 inside the grid's range


def _row_grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] on 128 levels spanning its own [min, max]: x = mid + step * u with
    u in [-64, 63], so that round(u) takes both ends in every row."""
    lo, hi = torch.aminmax(x, dim=1, keepdim=True)  # [M, 1] each
    span = (hi - lo).clamp_(min=1e-30)
    step = span * (1 / _ACT_LEVELS)
    mid = torch.add(lo, span, alpha=_ACT_ZERO / _ACT_LEVELS)  # the level g = 0 stands for
    return (x - mid).div_(step), mid, step


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
    weight: QuantizedWeight | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    activation_passes: int = 0,
) -> Kernel:
    """The fastest kernel for `weight` that passed its self-test here, else `DenseKernel`.

    `activation_passes` 1 or 2: an int8 weight takes `Int8DynamicKernel` where fbgemm runs
    (else the weight-only int8 kernel)."""
    if isinstance(weight, torch.Tensor):
        return DenseKernel(weight, dtype, device)
    if isinstance(weight, GgufBlocks):  # the native kernels are CPU kernels
        return (
            GgufKernel(weight, dtype)
            if device.type == "cpu"
            else DenseKernel(weight, dtype, device)
        )
    for kind in _kernel_classes(weight, dtype, device, activation_passes):
        key = (kind.name, device.type)
        if key not in _checked:
            _checked[key] = _self_test(kind, weight, device)
        if not _checked[key]:
            continue
        try:
            return kind(weight, device)  # type: ignore[arg-type]
        except (RuntimeError, NotImplementedError) as err:
            _fail(kind.name, f"{type(err).__name__}: {err}")
            _checked[key] = False
    return DenseKernel(weight, dtype, device)


KernelClass = (
    type[Int4CpuKernel] | type[Int4CudaKernel] | type[Int8Kernel] | type[Int8DynamicKernel]
)
_DYNAMIC = {1: Int8DynamicFastKernel, 2: Int8DynamicKernel}  # by activation passes


def _kernel_classes(
    weight: QuantizedWeight, dtype: torch.dtype, device: torch.device, activation_passes: int
) -> list[KernelClass]:
    """Candidates, best first; none where only the reference fits: float32 activations
    (exactness tests), odd shapes."""
    if dtype != torch.bfloat16:
        return []
    n, k = weight.shape
    if isinstance(weight, Int4Weight):
        if weight.group_size not in INT4_GROUP_SIZES or n % 16 or k % weight.group_size:
            return []
        return [Int4CudaKernel if device.type == "cuda" else Int4CpuKernel]
    dynamic: list[KernelClass] = []
    if activation_passes and device.type == "cpu":
        dynamic = [_DYNAMIC[activation_passes]]
    # The int8 op crashes on K not a multiple of 16; its CUDA version is a float32 loop without
    # tensor cores, slower than bf16 on cuBLAS at every M: a GPU dequantizes int8 weights.
    if k % 16 or device.type != "cpu":
        return dynamic
    return [*dynamic, Int8Kernel]


def _self_test(
    kind: KernelClass,
    weight: QuantizedWeight,
    device: torch.device,
) -> bool:
    """Run the kernel on the first rows of a real weight against F.linear on the same values."""
    rows = weight.rows(torch.arange(min(_SELF_TEST_ROWS, weight.shape[0])))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[1], generator=gen).to(device=device, dtype=torch.bfloat16)
    try:
        kernel = kind(rows, device)  # type: ignore[arg-type]
        got = torch.cat([kernel(x), kernel(x[:1])]).float()  # a batch, and a row alone
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        return _fail(kind.name, f"{type(err).__name__}: {err}")
    want = F.linear(x.float(), rows.dequantize(torch.float32).to(device))
    want = torch.cat([want, want[:1]])
    rel_err = ((got - want).norm() / want.norm().clamp(min=1e-12)).item()
    tolerance = getattr(kind, "tolerance", SELF_TEST_TOLERANCE)
    if not rel_err <= tolerance:
        return _fail(kind.name, f"relative error {rel_err:.2e} > {tolerance:.0e}")
    return True


def _fail(name: str, why: str) -> bool:
    log.warning(
        "quantized kernel %s failed its self-test (%s): those layers run dequantized bf16",
        name,
        why,
    )
    return False
