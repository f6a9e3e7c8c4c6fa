"""The decoder's RMSNorm and the variants some families need.

`RMSNorm` normalizes in float32 and rounds to the model dtype before the weight, as Llama's
reference does; Gemma's scales by 1 + weight and OLMo 2's by the weight, both in float32, rounding
after it (`late_round`). `FlatNorm` is one norm over a token's whole q or k projection rather than
per head (OLMo 2's q/k norms). `NoNorm` stands where a family has no norm (OLMo 2 before attention
and the MLP), so the layer's residual add stays where the norm would have fused it; `UnitNorm`
has no weight (Gemma 4's on the values).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels import fused_ops, gemma_ops


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, offset: bool = False, late_round: bool | None = None
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps
        self.offset = offset  # Gemma's: x * (1 + weight), the checkpoint holding weight
        # the weight applied in float32, rounded after (Gemma's, OLMo 2's); else before
        self.late_round = offset if late_round is None else late_round

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and round before the weight, as the reference implementations do;
        # Gemma's and OLMo 2's round after it (transformers' Gemma3RMSNorm, Olmo2RMSNorm).
        # Gemma's runs natively where the op does: the native layer stack calls the same one.
        if self.offset and gemma_ops.usable(x):
            rows = x.reshape(-1, x.shape[-1])
            out = gemma_ops.offset_rmsnorm(rows, None, self.weight, self.eps, x.dtype, x.dtype)[0]
            return out.view(x.shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.late_round:
            weight = 1.0 + self.weight.float() if self.offset else self.weight.float()
            return (x32 * weight).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output (float32 before rounding)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before it (None: none)
        out_dtype: torch.dtype,  # the model's, or float32 for a GEMM that reads float32
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual) in out_dtype, x + residual
        """The residual add and the norm after it, one native pass where the fused ops run (the
        same roundings as the eager ops); compiled graphs keep the eager ops for inductor to fuse,
        and late-rounding norms the eager ones (the native ops round before the weight), but
        Gemma's its own native one (engine.kernels.gemma_ops) where it runs."""
        if self.offset and residual is not None and gemma_ops.usable(residual):
            dtype = residual.dtype
            return gemma_ops.offset_rmsnorm(x, residual, self.weight, self.eps, dtype, out_dtype)
        if not self.late_round and not torch.compiler.is_compiling() and fused_ops.usable(x):
            if residual is None:
                return fused_ops.rmsnorm(x, self.weight, self.eps, out_dtype), x
            return fused_ops.add_rmsnorm(x, residual, self.weight, self.eps, out_dtype)
        total = x if residual is None else x.to(residual.dtype) + residual
        return self(total).to(out_dtype), total


class FlatNorm(RMSNorm):
    """One RMSNorm over all heads of a token's projection (OLMo 2's q_norm and k_norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, heads, head_dim] -> same
        return super().forward(x.flatten(-2)).view_as(x)


class NoNorm(nn.Module):
    """Where a family has no norm: the residual add alone, rounded as the next GEMM reads it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output (float32 before rounding)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before it (None: none)
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # x + residual in out_dtype, x + residual
        total = x if residual is None else x.to(residual.dtype) + residual
        return total.to(out_dtype), total


class UnitNorm(nn.Module):
    """RMSNorm without a weight, in float32, `pow(-1/2)` as transformers' Gemma4RMSNorm
    (Gemma 4's norm on the values)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> same
        x32 = x.float()
        return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
