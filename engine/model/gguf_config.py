"""A GGUF file's transformers config, completed where transformers' GGUF reader falls short.

transformers maps a GGUF's metadata keys onto config fields one by one. For Gemma 3 that is not
enough: llama.cpp's converter stores only the global layers' rope (`gemma3.rope.freq_base` and
`gemma3.rope.scaling.*`) and the window, and llama.cpp's loader (src/llama-model.cpp) derives
the rest: every sixth layer global, local layers rotating at 10,000 unscaled, the attention scale
1/sqrt(head_dim) except on the 62-layer 27B, whose query_pre_attn_scalar is hidden / heads.
transformers keeps its own defaults for those, and reads no rope scaling at all, so the 4B-27B
(linear x8 on global layers) would run with the wrong rope. Here each value is set from the file
as llama.cpp reads it; what llama.cpp would read but the decoder lacks is refused by name.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from engine.model.gguf_dense import OWN_CONFIG_ARCHS, complete_phi3, own_config
from engine.model.gguf_gemma4 import gemma4_config
from engine.model.gguf_hybrid import qwen35_config
from engine.model.quant.gguf_file import read_gguf_metadata

_GEMMA3_PATTERN = 6  # llama.cpp's set_swa_pattern(6): layers 5, 11, 17, ... are global
_GEMMA3_LOCAL_THETA = 10_000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is not head_dim's


def gguf_config(path: Path) -> PretrainedConfig:
    """transformers' config of the GGUF at `path`, with what it leaves out read from the file."""
    meta = read_gguf_metadata(path)
    if meta.get("general.architecture") == "gpt-oss":
        return gpt_oss_config(meta)
    if meta.get("general.architecture") == "gemma4":
        return gemma4_config(path, meta)
    if meta.get("general.architecture") in OWN_CONFIG_ARCHS:
        return own_config(path, meta)
    if meta.get("general.architecture") in ("qwen35", "qwen35moe"):  # the hybrid: gguf_hybrid
        return qwen35_config(path, meta)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    _complete_head_dim(config, meta)
    if meta.get("general.architecture") == "gemma3":
        _complete_gemma3(config, meta)
    if meta.get("general.architecture") == "qwen3moe":
        _complete_qwen3moe(config, meta)
    if meta.get("general.architecture") == "phi3":
        complete_phi3(config, meta, path)
    return config


def _complete_head_dim(config: PretrainedConfig, meta: dict[str, object]) -> None:
    """A head size other than hidden / heads, where the file says so: transformers reads
    `attention.key_length` for some architectures only (not qwen3's: Qwen3-0.6B's heads are 128
    wide at hidden 1024 and 16 heads, 4B's and 32B's too at hidden / heads = 80)."""
    key_length = meta.get(f"{meta.get('general.architecture')}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)  # type: ignore[call-overload]


def _complete_gemma3(config: PretrainedConfig, meta: dict[str, object]) -> None:
    def key(name: str) -> object:
        return meta.get(f"gemma3.{name}")

    window = key("attention.sliding_window")
    if window is None:  # llama.cpp refuses such a file too
        raise ValueError("Gemma 3 GGUF without gemma3.attention.sliding_window")
    layers = int(config.num_hidden_layers)
    config.sliding_window = int(window)  # type: ignore[call-overload]
    config.layer_types = _layer_types(key("attention.sliding_window_pattern"), layers)
    heads, head_dim = int(config.num_attention_heads), int(config.head_dim)
    big = layers == _GEMMA3_27B_LAYERS
    config.query_pre_attn_scalar = config.hidden_size // heads if big else head_dim
    config.final_logit_softcapping = key("final_logit_softcapping")  # refused if set
    local_theta = key("rope.freq_base_swa") or _GEMMA3_LOCAL_THETA
    config.rope_parameters = {
        "full_attention": _global_rope(meta, "gemma3"),
        "sliding_attention": {"rope_type": "default", "rope_theta": float(local_theta)},  # type: ignore[arg-type]
    }


def _complete_qwen3moe(config: PretrainedConfig, meta: dict[str, object]) -> None:
    """transformers does not read the experts' width; llama.cpp's qwen3moe renormalizes the
    top-k weights always (transformers' GGUF defaults say so too)."""
    width = meta.get("qwen3moe.expert_feed_forward_length")
    if width is None:
        raise ValueError("Qwen3-MoE GGUF without qwen3moe.expert_feed_forward_length")
    config.moe_intermediate_size = int(width)  # type: ignore[call-overload]
    config.norm_topk_prob = True


def gpt_oss_config(meta: dict[str, object]) -> PretrainedConfig:
    """gpt-oss's config from llama.cpp's keys (transformers' reader fails on its rope keys). The
    rest llama.cpp fixes as transformers' config does: every other layer windowed from layer 0,
    YaRN's betas 32 and 1, the SwiGLU limit 7."""
    from transformers import GptOssConfig

    def key(name: str, default: object = None) -> int:
        found = meta.get(f"gpt-oss.{name}")
        return int(str(default if found is None else found))

    rope = dict(GptOssConfig().rope_parameters or {})
    rope["rope_theta"] = float(str(meta.get("gpt-oss.rope.freq_base") or rope["rope_theta"]))
    rope["factor"] = float(str(meta.get("gpt-oss.rope.scaling.factor") or rope["factor"]))
    original = rope["original_max_position_embeddings"]
    rope["original_max_position_embeddings"] = key("rope.scaling.original_context_length", original)
    heads, tokens = key("attention.head_count"), meta.get("tokenizer.ggml.tokens")
    return GptOssConfig(
        vocab_size=key("vocab_size", len(tokens) if isinstance(tokens, list) else 0),
        hidden_size=key("embedding_length"),
        intermediate_size=key(
            "expert_feed_forward_length", meta.get("gpt-oss.feed_forward_length")
        ),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=key("attention.key_length"),
        num_local_experts=key("expert_count"),
        num_experts_per_tok=key("expert_used_count"),
        sliding_window=key("attention.sliding_window", 128),
        max_position_embeddings=key("context_length"),
        rms_norm_eps=float(str(meta.get("gpt-oss.attention.layer_norm_rms_epsilon") or 1e-5)),
        rope_parameters=rope,
        tie_word_embeddings=False,
        eos_token_id=_token(meta, "eos"),
        bos_token_id=_token(meta, "bos"),
        pad_token_id=_token(meta, "pad"),
    )


def _token(meta: dict[str, object], kind: str) -> int | None:
    found = meta.get(f"tokenizer.ggml.{'padding' if kind == 'pad' else kind}_token_id")
    return None if found is None else int(str(found))


def _layer_types(pattern: object, layers: int) -> list[str]:
    """llama.cpp's pattern: an int n (each n-th layer global) or one flag a layer (True: local)."""
    if isinstance(pattern, list):
        return ["sliding_attention" if p else "full_attention" for p in pattern[:layers]]
    n = int(pattern or _GEMMA3_PATTERN)  # type: ignore[call-overload]
    return ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(layers)]


def _global_rope(meta: dict[str, object], arch: str) -> dict[str, object]:
    """The rope of `arch`'s full-attention layers, as llama.cpp reads it: scaling type linear
    unless named, factor from rope.scale_linear (older files) or rope.scaling.factor."""
    theta = float(meta.get(f"{arch}.rope.freq_base") or 10_000.0)  # type: ignore[arg-type]
    kind = str(meta.get(f"{arch}.rope.scaling.type") or "linear")
    factor = meta.get(f"{arch}.rope.scale_linear") or meta.get(f"{arch}.rope.scaling.factor")
    factor = float(factor or 1.0)  # type: ignore[arg-type]
    if kind == "none" or factor == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "linear":
        raise ValueError(f"{arch} GGUF: rope scaling {kind!r} is not supported (only linear)")
    return {"rope_type": "linear", "factor": factor, "rope_theta": theta}
