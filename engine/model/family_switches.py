"""OLMo 2 and GLM-4 as configurations of the one decoder (engine.model.decoder).

OLMo 2 (`Olmo2ForCausalLM`) norms only after each sublayer, before its residual add (the
sandwich norms' post ones, `pre_norms` off), normalizes q and k over a token's whole projection
rather than per head (`qk_norm_flat`), and applies every norm's weight in float32 before rounding
(`norm_late_round`).

GLM-4 (`Glm4ForCausalLM`) has Gemma's four norms a layer under other names, q/k/v biases without
an o bias, gate and up fused in one matrix, and a partial rotary (half of each head by default) in
the interleaved layout: transformers rotates dims 2i and 2i + 1 of the first r together. At load
(`glm4_weights`) the norms take the decoder's names, gate/up is split, and each q and k head is
reordered alike (q . k unchanged) so those pairs land on the decoder's pairs j and j + head_dim/2
and the passed dims on the last pairs, which `rope.Rotary` leaves unrotated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from engine.model.decoder import WeightValue
from engine.model.rope import partial_rotary_factor
from engine.model.shape import DecoderShape

# GLM-4's norm names -> the decoder's sandwich norms (Gemma's names), in a layer
_GLM4_NORMS = {
    "post_self_attn_layernorm": "post_attention_layernorm",  # after attention
    "post_attention_layernorm": "pre_feedforward_layernorm",  # before the MLP
    "post_mlp_layernorm": "post_feedforward_layernorm",  # after the MLP
}


def olmo2_shape(config: PretrainedConfig) -> DecoderShape:
    _check_silu("Olmo2ForCausalLM", config)
    bias = bool(getattr(config, "attention_bias", False))
    shape = DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return replace(
        shape, sandwich_norms=True, pre_norms=False, qk_norm_flat=True, norm_late_round=True
    )


def glm4_shape(config: PretrainedConfig) -> DecoderShape:
    _check_silu("Glm4ForCausalLM", config)
    bias = bool(getattr(config, "attention_bias", True))
    shape = DecoderShape.from_config(config, qkv_bias=bias, o_bias=False, qk_norm=False)
    return replace(shape, sandwich_norms=True)


def _check_silu(architecture: str, config: PretrainedConfig) -> None:
    if getattr(config, "mlp_bias", False) or getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{architecture}: only bias-free SwiGLU (silu) MLPs are supported")


def glm4_weights(
    config: PretrainedConfig, weights: Iterable[tuple[str, WeightValue]]
) -> Iterator[tuple[str, WeightValue]]:
    """GLM-4's checkpoint in the decoder's names and layout (norms renamed, gate/up split, q and
    k rows reordered for its interleaved partial rotary)."""
    shape = DecoderShape.from_config(config, qkv_bias=True, o_bias=False, qk_norm=False)
    order = interleaved_order(shape.head_dim, int(shape.head_dim * partial_rotary_factor(config)))
    for name, value in weights:
        base, _, suffix = name.rpartition(".")
        layer, _, leaf = base.rpartition(".")
        if leaf in _GLM4_NORMS:
            yield f"{layer}.{_GLM4_NORMS[leaf]}.{suffix}", value
        elif base.endswith("mlp.gate_up_proj"):
            size = shape.intermediate_size
            yield f"{layer}.gate_proj.{suffix}", _rows(value, torch.arange(size))
            yield f"{layer}.up_proj.{suffix}", _rows(value, torch.arange(size, 2 * size))
        elif base.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = (shape.q_size if base.endswith("q_proj") else shape.kv_size) // shape.head_dim
            rows = torch.arange(heads * shape.head_dim).view(heads, -1)[:, order].flatten()
            yield name, _rows(value, rows)
        else:
            yield name, value


def interleaved_order(head_dim: int, rotary_dim: int) -> torch.Tensor:  # [head_dim] dims of a head
    """The decoder's dims of a head from an interleaved partial rotary's: its pair (2i, 2i + 1)
    on the decoder's (i, i + head_dim/2) for i < rotary_dim/2, the passed dims after them."""
    half, rotated = head_dim // 2, rotary_dim // 2
    dims = torch.arange(head_dim)
    passed = dims[2 * rotated :]  # 2 * (half - rotated) of them, split over the two halves
    first, second = passed[: half - rotated], passed[half - rotated :]
    return torch.cat([dims[0 : 2 * rotated : 2], first, dims[1 : 2 * rotated : 2], second])


def _rows(value: WeightValue, rows: torch.Tensor) -> WeightValue:
    return value[rows] if isinstance(value, torch.Tensor) else value.rows(rows)
