"""GGUF configs of the dense families transformers' GGUF reader does not complete or cannot read.

transformers reads a Phi-3 GGUF's config but drops what llama.cpp keeps elsewhere: the rotated
share of each head (`rope.dimension_count`) and longrope's factors, which the converter stores
as tensors (`rope_factors_long` / `rope_factors_short`) beside `rope.scaling.attn_factor`. Granite,
SmolLM3, OLMo 2 and GLM-4 files it refuses outright ("architecture ... is not supported yet"),
config and tokenizer alike; their configs are built here from llama.cpp's keys, each value as
llama.cpp's loader (src/models/<arch>.cpp) reads it, and the tokenizer from the file's own
vocabulary (transformers' tokenizer builder does not depend on the architecture).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerFast

from engine.model.quant.gguf_file import GgufTensorInfo, read_gguf

# llama.cpp architecture -> transformers model_type, for files transformers cannot read
OWN_CONFIG_ARCHS = {
    "granite": "granite",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "glm4": "glm4",
}
# tensors that hold config (longrope's factors), read here and skipped as weights
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_Key = Callable[..., object]  # a metadata value of the file's architecture, or a default
_SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp hard-codes it (n_no_rope_layer_step): layers 3, 7, ... NoPE


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """The file's tokenizer, built from its vocabulary, merges and special ids."""
    return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)


def own_config(path: Path, meta: dict[str, object]) -> PretrainedConfig:
    """The transformers config of a GGUF whose architecture transformers' reader refuses."""
    arch = str(meta["general.architecture"])
    _, tensors = read_gguf(path)
    by_name = {t.name: t for t in tensors}

    def key(name: str, default: object = None) -> object:
        found = meta.get(f"{arch}.{name}")
        return default if found is None else found

    _refuse_rope_scaling(arch, meta, by_name)
    heads, hidden = _int(key("attention.head_count")), _int(key("embedding_length"))
    head_dim = _int(key("attention.key_length", hidden // heads))
    config = AutoConfig.for_model(
        OWN_CONFIG_ARCHS[arch],
        vocab_size=_int(key("vocab_size", by_name["token_embd.weight"].data.shape[0])),
        hidden_size=hidden,
        intermediate_size=_int(key("feed_forward_length")),
        num_hidden_layers=_int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=_int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=_int(key("context_length")),
        rms_norm_eps=_float(key("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": _float(key("rope.freq_base", 1e4))},
        tie_word_embeddings="output.weight" not in by_name,
        attention_bias="blk.0.attn_q.bias" in by_name or "blk.0.attn_qkv.bias" in by_name,
        **_special_ids(meta),
    )
    _ARCH_SWITCHES[arch](config, key)
    return config


def _int(value: object) -> int:
    return int(value)  # type: ignore[call-overload]


def _float(value: object) -> float:
    return float(value)  # type: ignore[arg-type]


def _special_ids(meta: dict[str, object]) -> dict[str, int]:
    names = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    ids = {field: meta.get(f"tokenizer.ggml.{k}_token_id") for field, k in names.items()}
    return {field: _int(v) for field, v in ids.items() if v is not None}


def _refuse_rope_scaling(
    arch: str, meta: dict[str, object], tensors: dict[str, GgufTensorInfo]
) -> None:
    """Rope scaling on these families (llama3's rope_freqs tensor, yarn, linear) is not read here:
    refused by name rather than served with a plain rope."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if (kind not in (None, "none")) or "rope_freqs.weight" in tensors:
        raise ValueError(f"{arch} GGUF with rope scaling ({kind or 'rope_freqs'}) is not supported")


def _granite(config: PretrainedConfig, key: _Key) -> None:
    """llama.cpp's Granite: logit_scale required; the other scales optional, 0 (absent) meaning
    none, and no attention scale meaning head_dim's."""
    config.logits_scaling = _float(key("logit_scale"))
    config.embedding_multiplier = _float(key("embedding_scale", 1.0))
    config.residual_multiplier = _float(key("residual_scale", 1.0))
    scale = key("attention.scale") or config.head_dim**-0.5
    config.attention_multiplier = _float(scale)


def _smollm3(config: PretrainedConfig, key: _Key) -> None:
    step = _SMOLLM3_NO_ROPE_STEP
    config.no_rope_layer_interval = step
    config.no_rope_layers = [int((i + 1) % step != 0) for i in range(config.num_hidden_layers)]


def _olmo2(config: PretrainedConfig, key: _Key) -> None:
    if key("attention.sliding_window"):  # OLMo 3's windows: the decoder does not keep them
        raise ValueError("olmo2 GGUF with attention.sliding_window (OLMo 3) is not supported")


def _glm4(config: PretrainedConfig, key: _Key) -> None:
    rotated = _int(key("rope.dimension_count", config.head_dim))
    config.partial_rotary_factor = rotated / config.head_dim
    config.rope_parameters["partial_rotary_factor"] = config.partial_rotary_factor


def complete_phi3(config: PretrainedConfig, meta: dict[str, object], path: Path) -> None:
    """What transformers' reader leaves out of a Phi-3 file: the rotated share of each head, the
    longrope factors (tensors of the file) and their original length and attention factor; and
    the window, which llama.cpp ignores for Phi-3 (attention stays full), as here."""
    head_dim = config.hidden_size // config.num_attention_heads
    rotated = _int(meta.get("phi3.rope.dimension_count") or head_dim)
    params: dict[str, object] = {
        "rope_type": "default",
        "rope_theta": float(config.rope_parameters["rope_theta"]),
    }
    factors = {t.name: t.data for t in read_gguf(path)[1] if t.name in ROPE_FACTOR_TENSORS}
    if factors:
        original = _int(meta["phi3.rope.scaling.original_context_length"])
        params |= {
            "rope_type": "longrope",
            "long_factor": [float(f) for f in factors["rope_factors_long.weight"]],
            "short_factor": [float(f) for f in factors["rope_factors_short.weight"]],
            "original_max_position_embeddings": original,
        }
        config.original_max_position_embeddings = original
        attn_factor = meta.get("phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            params["attention_factor"] = _float(attn_factor)
    if rotated != head_dim:
        params["partial_rotary_factor"] = rotated / head_dim
        config.partial_rotary_factor = rotated / head_dim
    config.rope_parameters = params
    config.sliding_window = None


_ARCH_SWITCHES = {"granite": _granite, "smollm3": _smollm3, "olmo2": _olmo2, "glm4": _glm4}
