"""Model families the engine runs with its own forward pass."""

from __future__ import annotations

from transformers import PretrainedConfig

from engine.model.decoder import DecoderModel, DecoderShape

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
)

# model_type -> architecture, for configs (e.g. from GGUF) that do not name one
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def check_supported(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def build_decoder(architecture: str, config: PretrainedConfig) -> DecoderModel:
    """An uninitialized module (build it under a meta or target device context)."""
    check_supported(architecture)
    if getattr(config, "mlp_bias", False) or getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError("only bias-free SwiGLU (silu) MLPs are supported")
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = architecture == "Qwen2ForCausalLM" or attention_bias
    qk_norm = architecture == "Qwen3ForCausalLM"
    shape = DecoderShape.from_config(
        config, qkv_bias=qkv_bias, o_bias=attention_bias, qk_norm=qk_norm
    )
    return DecoderModel(shape)


__all__ = [
    "ARCHITECTURE_OF_MODEL_TYPE",
    "SUPPORTED_ARCHITECTURES",
    "DecoderModel",
    "DecoderShape",
    "build_decoder",
    "check_supported",
]
