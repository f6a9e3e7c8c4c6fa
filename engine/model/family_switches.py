"""OLMo 2, GLM-4 and Gemma 4 as configurations of the one decoder (engine.model.decoder).

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

Gemma 4 (`Gemma4ForCausalLM`, its text decoder) is Gemma 3's layer with norms that scale by the
weight (late rounding, no offset), attention scale 1, a weightless norm on the values, a learned
scalar on each layer's output, soft-capped logits, and full-attention layers of their own head
size and KV heads (`DecoderShape.attention_shape`) whose rope is transformers' `proportional` one.
Where those layers' values are the key projection (`attention_k_eq_v`), the checkpoint's k_proj
is loaded as v_proj too (`gemma4_weights`). Per-layer embeddings and KV-shared layers (E2B,
E4B) are engine.model.gemma4's; the MoE block (26B-A4B) and bidirectional attention are refused.
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


_GEMMA4_REFUSED = (  # settings of the released models the decoder does not do yet
    "enable_moe_block",  # a routed MLP beside the dense one (26B-A4B)
    "use_bidirectional_attention",
)


def gemma4_shape(config: PretrainedConfig) -> DecoderShape:
    for name in _GEMMA4_REFUSED:
        if getattr(config, name, None):
            raise ValueError(f"Gemma4ForCausalLM with {name}={getattr(config, name)!r}: not yet")
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    types = set(config.layer_types)
    if activation != "gelu_pytorch_tanh" or types - {"sliding_attention", "full_attention"}:
        raise ValueError(f"Gemma 4 with {activation!r} or layer types {sorted(types)}")
    bias = bool(getattr(config, "attention_bias", False))
    # head_dim and KV heads are per layer type: the local layers' as the shape's own
    layers = config.per_layer_config  # by layer type (and index)
    kind = "sliding_attention" if "sliding_attention" in types else "full_attention"
    local, full = layers[kind], layers["full_attention"]  # type: ignore[call-overload]
    shape = DecoderShape.from_config(local, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return replace(
        shape,
        norm_late_round=True,
        activation="gelu_tanh",
        sandwich_norms=True,
        embed_scale=float(config.hidden_size) ** 0.5,
        attention_multiplier=1.0,
        sliding_window=int(config.sliding_window),
        layer_types=tuple(config.layer_types),
        global_head_dim=int(full.head_dim),
        global_kv_heads=int(full.num_key_value_heads),
        v_norm=True,
        layer_scalar=True,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
    )


def gemma4_weights(
    config: PretrainedConfig, weights: Iterable[tuple[str, WeightValue]]
) -> Iterator[tuple[str, WeightValue]]:
    """Gemma 4's checkpoint; a full-attention layer whose values are its keys' projection
    (`attention_k_eq_v`) gets its k_proj as v_proj too, so the decoder's fused q/k/v computes v
    exactly as k before the norms (k takes k_norm, v the weightless v_norm)."""
    k_is_v = bool(getattr(config, "attention_k_eq_v", False))
    full = {i for i, t in enumerate(config.layer_types) if t == "full_attention"}
    layers = len(config.layer_types)
    shared = set(range(layers - int(config.num_kv_shared_layers or 0), layers))
    for name, value in weights:
        base, _, suffix = name.rpartition(".")
        layer = _layer_of(name)
        if layer in shared:  # a KV-shared layer keeps its query alone (engine.model.gemma4)
            if base.endswith("self_attn.q_proj"):
                yield f"{base.removesuffix('q_proj')}query.{suffix}", value
            elif not base.endswith(("k_proj", "v_proj", "k_norm", "v_norm")):
                yield name, value
            continue
        yield name, value
        if k_is_v and base.endswith("self_attn.k_proj") and layer in full:
            yield f"{base.removesuffix('k_proj')}v_proj.{suffix}", value


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None
