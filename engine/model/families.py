"""Model families the engine runs with its own forward pass.

Every family is a configuration of the one decoder (engine.model.decoder): `build_decoder`
reads a transformers config into a `DecoderShape`, whose switches say where a family departs
from Llama (QKV bias, q/k norms, Gemma's offset norms, GeGLU, sandwich norms, scaled
embeddings, sliding-window layers). A config asking for something the decoder does not do is
refused here, by name, rather than served inexactly.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from engine.model.decoder import DecoderModel, DecoderShape

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Gemma3ForCausalLM",
)

# model_type -> architecture, for configs (e.g. from GGUF) that do not name one
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

_GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")


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
    if getattr(config, "mlp_bias", False) or getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError("only bias-free SwiGLU (silu) MLPs are supported")
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = architecture == "Qwen2ForCausalLM" or attention_bias
    qk_norm = architecture == "Qwen3ForCausalLM"
    shape = DecoderShape.from_config(
        config, qkv_bias=qkv_bias, o_bias=attention_bias, qk_norm=qk_norm
    )
    return DecoderModel(shape)


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


__all__ = [
    "ARCHITECTURE_OF_MODEL_TYPE",
    "SUPPORTED_ARCHITECTURES",
    "DecoderModel",
    "DecoderShape",
    "build_decoder",
    "check_supported",
]
