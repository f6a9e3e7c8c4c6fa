"""A routed MLP's experts as one native call a step (csrc/moe.cpp `MoeExperts`).

Where every expert is a gated SiLU MLP (Qwen3-MoE's) whose gate_up and down are each one GGUF
matrix on the native kernels, one type for all the experts' gate_up and one for their down, the
chosen experts of a whole step run in two parallel passes (every gate_up tile, then every down
tile) instead of two `gguf_mm` calls an expert: the activations rounded once, the same products
and the same sum (`MoE.forward`'s, in increasing expert id, in the model dtype), bit for bit. The
native layer stack (engine.model.decoder_stack) calls the same C++ function for its routed layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.kernels import fused_ops
from engine.model.quant.linear import QuantLinear
from engine.model.quant.native import ACTIVATION_PASSES, GgufKernel


@dataclass(frozen=True)
class ExpertBlocks:
    """Every expert's packed blocks, as MoeExperts and DecoderStack take them."""

    gate_up: list[torch.Tensor]  # [experts] each [2 * width, bytes] uint8
    down: list[torch.Tensor]  # [experts] each [hidden, bytes] uint8
    gate_up_qtype: int
    down_qtype: int


class NativeExperts(Protocol):
    """csrc/moe.cpp's MoeExperts."""

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] float32: the model dtype's values
        ids: torch.Tensor,  # [T, k] int64: each row's experts
        weights: torch.Tensor,  # [T, k] in the model dtype
    ) -> torch.Tensor: ...  # [T, hidden] in the model dtype


def expert_blocks(experts: nn.ModuleList) -> ExpertBlocks | None:
    """The blocks of experts that are gated SiLU MLPs (the caller knows), or None where they do
    not all run as one native call."""
    if ACTIVATION_PASSES != 1 or not fused_ops.loaded():
        return None
    gate_up, down = [], []
    for expert in experts:
        pair = [_one_gguf_kernel(expert.gate_up_proj), _one_gguf_kernel(expert.down_proj)]
        if pair[0] is None or pair[1] is None:
            return None
        gate_up.append(pair[0])
        down.append(pair[1])
    qtypes = {(a.qtype, b.qtype) for a, b in zip(gate_up, down, strict=True)}
    if len(qtypes) != 1:
        return None
    ((gate_up_qtype, down_qtype),) = qtypes
    return ExpertBlocks(
        [k.blocks for k in gate_up], [k.blocks for k in down], gate_up_qtype, down_qtype
    )


def build(experts: nn.ModuleList) -> NativeExperts | None:
    """The native experts (gated SiLU MLPs: the caller knows), or None where they do not apply
    (the eager grouping then runs)."""
    blocks = expert_blocks(experts)
    if blocks is None or not _library_has_experts():
        return None
    native: NativeExperts = torch.classes.specserve_kernels.MoeExperts(
        blocks.gate_up, blocks.down, blocks.gate_up_qtype, blocks.down_qtype
    )
    return native


def router_logits(
    x: torch.Tensor,  # [T, hidden] float32: the model dtype's values
    weight: torch.Tensor,  # [num_experts, hidden] in the model dtype
) -> torch.Tensor:  # [T, num_experts] in the model dtype: x W^T, each row alone (csrc/moe.cpp)
    logits: torch.Tensor = torch.ops.specserve_kernels.router_logits(x, weight)
    return logits


def _one_gguf_kernel(linear: object) -> GgufKernel | None:
    if not isinstance(linear, QuantLinear) or linear.bias is not None or len(linear.kernels) != 1:
        return None
    kernel = linear.kernels[0]
    return kernel if isinstance(kernel, GgufKernel) else None


def _library_has_experts() -> bool:
    try:
        torch.classes.specserve_kernels.MoeExperts  # noqa: B018 (a lookup that raises if absent)
    except (AttributeError, RuntimeError):
        return False
    return True
