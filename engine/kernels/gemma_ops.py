"""Gemma's small ops' Python face (engine/kernels/csrc/gemma.cpp): the offset RMSNorm
(x * (1 + weight), rounded once, with the residual add before it) and the GeGLU activation.

engine/model/decoder.py calls them wherever they run, and the native layer stack
(csrc/layers.cpp) calls the same ones, so a Gemma layer is computed bit for bit alike on both.
Where they do not run (another device, float16, a compiled graph, `SPECSERVE_FUSED_OPS=0`), the
eager references below do, transformers' ops in transformers' order.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from engine.kernels import build, fused_ops


@cache
def loaded() -> bool:
    """The native library is loaded and offers the Gemma ops (probed once)."""
    return build.load() and "gelu_tanh_mul" in build.ops()


def usable(x: torch.Tensor) -> bool:
    """Whether the native ops run for activations like x (else the references do)."""
    return fused_ops.usable(x) and not torch.compiler.is_compiling() and loaded()


def offset_rmsnorm(
    x: torch.Tensor,  # [M, H] in dtype, or float32 not yet rounded to it (rows contiguous)
    residual: torch.Tensor | None,  # [M, H] dtype; None: no residual add
    weight: torch.Tensor,  # [H] dtype: the checkpoint's w of (1 + w)
    eps: float,
    dtype: torch.dtype,  # the model's: where the eager ops round
    out_dtype: torch.dtype,  # dtype, or float32 for a GEMM that reads float32
    isa: str = "auto",  # "scalar", "avx2", "avx512" pin a variant (tests)
) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual) [M, H] out_dtype, x + residual
    out, total = torch.ops.specserve_kernels.offset_rmsnorm(
        x if x.stride(-1) == 1 else x.contiguous(), residual, weight, eps, dtype, out_dtype, isa
    )
    return out, total


def offset_rmsnorm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    dtype: torch.dtype, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """transformers' Gemma3RMSNorm after the residual add, in its roundings."""
    total = x.to(dtype) if residual is None else x.to(dtype) + residual
    x32 = total.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(dtype).to(out_dtype), total


def gelu_tanh_mul(
    gate_up: torch.Tensor,  # [M, 2I]: float32, or dtype
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    isa: str = "auto",
) -> torch.Tensor:  # [M, I] out_dtype
    out: torch.Tensor = torch.ops.specserve_kernels.gelu_tanh_mul(
        gate_up.contiguous(), dtype, out_dtype, isa
    )
    return out


def gelu_tanh_mul_reference(
    gate_up: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:  # [M, I]: gelu_tanh(gate) * up, in transformers' roundings
    gate, up = gate_up.to(dtype).chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(out_dtype)
