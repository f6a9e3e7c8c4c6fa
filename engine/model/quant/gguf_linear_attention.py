"""The linear-attention tensors of a `qwen35` GGUF under transformers' names, the converter's
value transforms undone (engine.model.gguf_hybrid says which, and why the v-head order stays)."""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

HYBRID_ARCHS = ("qwen35",)
# per-layer GGUF tensor -> transformers' name under model.layers.N
_LINEAR_TENSORS = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_TRANSFORMED = (".A_log", "conv1d.weight", "norm.weight")  # names from_file changes


class _Dequantizable(Protocol):
    def dequantize(self, dtype: torch.dtype = ...) -> torch.Tensor: ...


W = TypeVar("W", bound=torch.Tensor | _Dequantizable)


def linear_names(num_layers: int) -> dict[str, str]:
    """Full GGUF tensor names of the linear-attention layers -> transformers' full names (ssm_a
    has no `.weight`: the base/suffix split the other tensors take does not fit it)."""
    return {
        f"blk.{i}.{gguf_name}": f"model.layers.{i}.{hf_name}"
        for i in range(num_layers)
        for gguf_name, hf_name in _LINEAR_TENSORS.items()
    }


def is_mtp_tensor(name: str, num_layers: int) -> bool:
    """A tensor of the MTP blocks the converter appends after the trunk (skipped)."""
    parts = name.split(".")
    return parts[0] == "blk" and int(parts[1]) >= num_layers


def from_file(hf_name: str, value: W) -> W | torch.Tensor:
    """A tensor as transformers holds it, undoing the converter's value transforms (the v-head
    order stays tiled: see the module's docstring); the matrices pass as read."""
    if not hf_name.endswith(_TRANSFORMED):
        return value
    # llama.cpp keeps these in F32; dequantized if not
    x = value if isinstance(value, torch.Tensor) else value.dequantize()
    if hf_name.endswith(".A_log"):  # the file holds A = -exp(A_log)
        return torch.log(-x.double()).float()
    if hf_name.endswith("conv1d.weight"):  # [C, K] -> [C, 1, K]
        return x.reshape(x.shape[0], 1, -1)
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return x.float() - 1.0  # as Gemma 3's (gguf_weights._unshifted)
    return x
