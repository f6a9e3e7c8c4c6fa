"""Model families the engine runs with its own forward pass.

Every family is a configuration of the one decoder (engine.model.decoder): `build_decoder`
reads a transformers config into a `DecoderShape`, whose switches say where a family departs
from Llama (QKV bias, q/k norms, Gemma's offset norms, GeGLU, sandwich norms, scaled
embeddings, sliding-window layers; Granite's multipliers; SmolLM3's layers without rope;
OLMo 2's and GLM-4's, engine.model.family_switches;
Qwen3-MoE's and gpt-oss's routed experts, engine.model.moe; gpt-oss's attention sinks).
Phi-3/Phi-4 is Llama's layer as it is; only its checkpoint differs, with q/k/v and gate/up
already fused and (Phi-4-mini) a partial rotary (`split_fused`).
A config asking for something the decoder does not do is refused here, by name, rather than
served inexactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from engine.model.decoder import DecoderModel, WeightValue
from engine.model.family_switches import (
    gemma4_shape,
    gemma4_weights,
    glm4_shape,
    glm4_weights,
    olmo2_shape,
)
from engine.model.gemma4 import build_gemma4, gemma4_extras
from engine.model.hybrid import build_qwen3_5
from engine.model.moe import split_gpt_oss_experts, split_stacked_experts
from engine.model.rope import partial_rotary_factor
from engine.model.shape import DecoderShape, MoeShape

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "GraniteForCausalLM",
    "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM",
    "Glm4ForCausalLM",
    "Gemma4ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
)

# model_type -> architecture, for configs (e.g. from GGUF) that do not name one
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

# multimodal checkpoints whose text model is served (the vision tower's weights are skipped)
TEXT_MODEL_OF = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM"}

_GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")
_SWITCHED = {"Olmo2ForCausalLM": olmo2_shape, "Glm4ForCausalLM": glm4_shape}


def text_model(architecture: str, config: PretrainedConfig) -> tuple[str, PretrainedConfig]:
    """The architecture and config to serve: a multimodal checkpoint's text model (Qwen3.5 is
    published as Qwen3_5ForConditionalGeneration), else the checkpoint's own."""
    text = TEXT_MODEL_OF.get(architecture)
    if text is None:
        return architecture, config
    text_config = config.get_text_config()
    text_config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    text_config.architectures = [text]
    return text, text_config


def check_supported(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def build_decoder(architecture: str, config: PretrainedConfig) -> DecoderModel:
    """An uninitialized module (build it under a meta or target device context)."""
    check_supported(architecture)
    if architecture == "Gemma3ForCausalLM":
        return DecoderModel(_gemma3_shape(config))
    if architecture == "Qwen3_5ForCausalLM":  # linear attention beside full attention
        return build_qwen3_5(config)
    if architecture == "Qwen3MoeForCausalLM":
        return DecoderModel(_qwen3_moe_shape(config))
    if architecture == "GptOssForCausalLM":
        return DecoderModel(_gpt_oss_shape(config))
    if architecture == "Gemma4ForCausalLM":  # per-layer embeddings, KV sharing: engine.model.gemma4
        return build_gemma4(gemma4_shape(config), gemma4_extras(config))
    if architecture in _SWITCHED:  # engine.model.family_switches
        return DecoderModel(_SWITCHED[architecture](config))
    if partial_rotary_factor(config) != 1.0 and architecture != "Phi3ForCausalLM":
        raise ValueError(f"{architecture} with partial_rotary_factor: only Phi-3's is reordered")
    if getattr(config, "mlp_bias", False) or getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError("only bias-free SwiGLU (silu) MLPs are supported")
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = architecture == "Qwen2ForCausalLM" or attention_bias
    qk_norm = architecture == "Qwen3ForCausalLM"
    shape = DecoderShape.from_config(
        config, qkv_bias=qkv_bias, o_bias=attention_bias, qk_norm=qk_norm
    )
    if architecture == "GraniteForCausalLM":
        shape = _granite_switches(config, shape)
    if architecture == "SmolLM3ForCausalLM":
        shape = _smollm3_switches(config, shape)
    if architecture in ("MistralForCausalLM", "Qwen2ForCausalLM"):
        shape = _window_switches(architecture, config, shape)
    return DecoderModel(shape)


def _window_switches(
    architecture: str, config: PretrainedConfig, shape: DecoderShape
) -> DecoderShape:
    """Mistral's window on every layer; Qwen2's (with use_sliding_window) on the layers from
    max_window_layers on, as transformers' config lists them in layer_types. Windowed layers are
    of another kind than full ones, so such a model runs the Python layer loop."""
    window = getattr(config, "sliding_window", None)
    if architecture == "MistralForCausalLM":
        types = ("sliding_attention",) * shape.num_layers if window else ()
    else:  # transformers' Qwen2Config drops the window without use_sliding_window
        types = tuple(getattr(config, "layer_types", None) or ())
    if not window or "sliding_attention" not in types:
        return shape
    return replace(shape, sliding_window=int(window), layer_types=types)


def _granite_switches(config: PretrainedConfig, shape: DecoderShape) -> DecoderShape:
    """Granite: Llama's layer with four constants of its config (transformers' defaults 1.0)."""
    return replace(
        shape,
        embedding_multiplier=float(config.embedding_multiplier),
        attention_multiplier=float(config.attention_multiplier),
        residual_multiplier=float(config.residual_multiplier),
        logits_scaling=float(config.logits_scaling),
    )


def _smollm3_switches(config: PretrainedConfig, shape: DecoderShape) -> DecoderShape:
    """SmolLM3: Llama's layer, but where `no_rope_layers[i]` is 0 layer i attends unrotated
    (the config fills the list from `no_rope_layer_interval`: every fourth layer by default).
    Its optional sliding window (on those layers only) is refused: the decoder does not keep it."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError("SmolLM3ForCausalLM with use_sliding_window is not supported")
    uses_rope = list(config.no_rope_layers)
    if len(uses_rope) != shape.num_layers:
        raise ValueError(f"SmolLM3 no_rope_layers has {len(uses_rope)} entries, not one a layer")
    return replace(shape, no_rope_layers=tuple(i for i, use in enumerate(uses_rope) if not use))


def _qwen3_moe_shape(config: PretrainedConfig) -> DecoderShape:
    """Qwen3-MoE: Qwen3's layer (q/k norms) with a routed MLP in every `decoder_sparse_step`-th
    layer not in `mlp_only_layers` (all of them in the released models); the others keep a
    dense MLP of `intermediate_size`."""
    if getattr(config, "use_sliding_window", False):
        raise ValueError("Qwen3MoeForCausalLM with use_sliding_window is not supported")
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen3-MoE with hidden_act {config.hidden_act!r}: only silu")
    bias = bool(getattr(config, "attention_bias", False))
    shape = DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, qk_norm=True)
    step, dense = int(config.decoder_sparse_step), set(config.mlp_only_layers or ())
    layers = tuple(
        i
        for i in range(shape.num_layers)
        if i not in dense and config.num_experts > 0 and (i + 1) % step == 0
    )
    moe = MoeShape(
        num_experts=int(config.num_experts),
        top_k=int(config.num_experts_per_tok),
        expert_size=int(config.moe_intermediate_size),
        layers=layers,
        norm_topk_prob=bool(config.norm_topk_prob),
    )
    return replace(shape, moe=moe)


def _gpt_oss_shape(config: PretrainedConfig) -> DecoderShape:
    """gpt-oss: biased attention with a sink logit per head, layers alternating a sliding
    window with full attention, and in every layer routed experts with biases and a clamped
    SwiGLU (top k of the router's biased logits, softmax over those k)."""
    unknown = set(config.layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"gpt-oss layer types {sorted(unknown)} are not supported")
    bias = bool(config.attention_bias)
    shape = DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, qk_norm=False)
    moe = MoeShape(
        num_experts=int(config.num_local_experts),
        top_k=int(config.num_experts_per_tok),
        expert_size=int(config.intermediate_size),
        layers=tuple(range(shape.num_layers)),
        topk_then_softmax=True,
        router_bias=True,
        swiglu_limit=float(config.swiglu_limit),
        swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
    )
    window = int(config.sliding_window) if "sliding_attention" in config.layer_types else None
    return replace(
        shape,
        moe=moe,
        attention_sinks=True,
        norm_late_round=True,  # GptOssRMSNorm: times the weight in float32, then rounded
        sliding_window=window,
        layer_types=tuple(config.layer_types),
    )


def _gemma3_shape(config: PretrainedConfig) -> DecoderShape:
    """Gemma 3's text decoder: Llama's with Gemma's switches on."""
    _check_gemma3(config)
    bias = bool(getattr(config, "attention_bias", False))
    shape = DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, qk_norm=True)
    return replace(
        shape,
        norm_offset=True,
        activation="gelu_tanh",
        sandwich_norms=True,
        embed_scale=float(config.hidden_size) ** 0.5,
        query_pre_attn_scalar=float(config.query_pre_attn_scalar),
        sliding_window=int(config.sliding_window),
        layer_types=tuple(config.layer_types),
    )


def _check_gemma3(config: PretrainedConfig) -> None:
    """Refuse what the decoder would get wrong, naming the setting."""
    refused = {
        "final_logit_softcapping": getattr(config, "final_logit_softcapping", None),
        "attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None),
        "use_bidirectional_attention": getattr(config, "use_bidirectional_attention", None),
    }
    for name, value in refused.items():
        if value:
            raise ValueError(f"Gemma3ForCausalLM with {name}={value!r} is not supported")
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {activation!r}: only gelu_pytorch_tanh")
    unknown = set(config.layer_types) - set(_GEMMA3_LAYER_TYPES)
    if unknown or not config.sliding_window:
        raise ValueError(f"Gemma 3 layer types {sorted(unknown)} or no sliding_window")


# checkpoint matrices that hold several of the decoder's, row blocks in this order (Phi-3's)
_FUSED_IN_CHECKPOINT = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def split_fused(
    architecture: str, config: PretrainedConfig, weights: Iterable[tuple[str, WeightValue]]
) -> Iterator[tuple[str, WeightValue]]:
    """Phi-3's fused q/k/v and gate/up matrices as the separate ones the other families' checkpoints
    hold, so quantization and tensor parallelism load them as they load those (the decoder fuses
    them again, its own way), q and k heads reordered for partial rotary; other architectures'
    weights pass through; stacked experts (a GGUF converted by transformers) split per expert."""
    if architecture == "Qwen3MoeForCausalLM":
        yield from split_stacked_experts(weights)  # type: ignore[arg-type]
        return
    if architecture == "GptOssForCausalLM":
        yield from split_gpt_oss_experts(weights)  # type: ignore[arg-type]
        return
    if architecture == "Glm4ForCausalLM":
        yield from glm4_weights(config, weights)
        return
    if architecture == "Gemma4ForCausalLM":
        yield from gemma4_weights(config, weights)
        return
    if architecture != "Phi3ForCausalLM":
        yield from weights
        return
    shape = DecoderShape.from_config(config, qkv_bias=False, o_bias=False, qk_norm=False)
    sizes = {
        "self_attn.qkv_proj": [shape.q_size, shape.kv_size, shape.kv_size],
        "mlp.gate_up_proj": [shape.intermediate_size] * 2,
    }
    order = _rotary_order(shape.head_dim, int(shape.head_dim * partial_rotary_factor(config)))
    for name, value in weights:
        base, _, suffix = name.rpartition(".")
        fused = next((f for f in _FUSED_IN_CHECKPOINT if base.endswith(f)), None)
        if fused is None:
            yield name, value
            continue
        prefix, start = base.removesuffix(fused), 0
        for part, size in zip(_FUSED_IN_CHECKPOINT[fused], sizes[fused], strict=True):
            rows = torch.arange(start, start + size)
            if part in ("self_attn.q_proj", "self_attn.k_proj"):  # [heads * head_dim] rows
                rows = rows.view(-1, shape.head_dim)[:, order].flatten()
            yield f"{prefix}{part}.{suffix}", _rows(value, rows)
            start += size


def _rows(value: WeightValue, rows: torch.Tensor) -> WeightValue:
    return value[rows] if isinstance(value, torch.Tensor) else value.rows(rows)


def _rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:  # [head_dim] dims of a head
    """Partial rotary as the decoder's whole-head rope. transformers rotates dims i and i + r/2
    of the first r = rotary_dim and passes the rest; the decoder pairs j and j + head_dim/2.
    Each q and k head reordered alike (q . k unchanged) puts transformers' pairs on the decoder's
    first pairs and the passed dims on the last ones, which `rope.Rotary` leaves unrotated.
    The identity when every dim rotates."""
    half, rotated = head_dim // 2, rotary_dim // 2
    dims = torch.arange(head_dim)
    passed = dims[2 * rotated :]  # 2 * (half - rotated) of them, split over the two halves
    first, second = passed[: half - rotated], passed[half - rotated :]
    return torch.cat([dims[:rotated], first, dims[rotated : 2 * rotated], second])


__all__ = [
    "ARCHITECTURE_OF_MODEL_TYPE",
    "SUPPORTED_ARCHITECTURES",
    "DecoderModel",
    "DecoderShape",
    "build_decoder",
    "check_supported",
    "split_fused",
    "text_model",
]
