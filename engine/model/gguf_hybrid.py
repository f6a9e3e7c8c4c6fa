"""The hybrid Qwen3.5 from a GGUF file: llama.cpp's `qwen35` architecture read back.

llama.cpp's converter (conversion/qwen.py: Qwen3_5TextModel, from Qwen3NextModel and
_LinearAttentionVReorderBase) writes the Gated DeltaNet sizes as `ssm.*` keys (conv_kernel,
state_size = k head dim, group_count = k heads, time_step_rank = v heads, inner_size = v heads *
v head dim), the layer kinds as `attention.recurrent_layers` (or `full_attention_interval`), the
rotated share of each head as `rope.dimension_count`, and transforms the tensors:

- A_log becomes `ssm_a` = -exp(A_log) (read back as log(-A), in float64);
- dt_bias becomes `ssm_dt.bias`; conv1d [C, 1, K] is squeezed to [C, K];
- every RMSNorm weight but the gated one (`linear_attn.norm`, `ssm_norm`) is stored as 1 + w;
- where v heads outnumber k heads, the v heads are reordered from grouped by k head
  ([k0: v0 v1, k1: v0 v1]) to tiled ([k0 v0, k1 v0, k0 v1, k1 v1]) in the in-projection's v rows,
  z, a, b, A, dt_bias, the conv's v channels and out_proj's columns.

The tiled order is kept, not undone: out_proj's columns cannot be permuted inside quantized
blocks, and the layer computes the same in either order once each v head reads its own k head
(p % k_heads when tiled, p // (v_heads / k_heads) when grouped): the config says which
(`linear_value_heads_tiled`, read by LinearAttentionShape). So every matrix is used as stored.
The MTP layers a file may carry (`nextn_predict_layers`, blocks past the trunk) are skipped.
The tensors' side is engine.model.quant.gguf_linear_attention; the config's is here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from engine.model.quant.gguf_file import GgufTensorInfo, read_gguf
from engine.model.quant.gguf_linear_attention import HYBRID_ARCHS

TILED_FLAG = "linear_value_heads_tiled"  # config attribute: v heads in llama.cpp's tiled order
_LINEAR = "linear_attention"


def qwen35_config(path: Path, meta: dict[str, object]) -> PretrainedConfig:
    """The `qwen3_5_text` config of a `qwen35` GGUF, each value as llama.cpp's loader
    (src/models/qwen35.cpp) reads it; what it would read but the decoder lacks is refused."""
    arch = str(meta["general.architecture"])
    if arch not in HYBRID_ARCHS:
        raise ValueError(f"{arch} GGUF: only qwen35 is served (the MoE qwen35moe is not)")

    def key(name: str, default: object = None) -> object:
        found = meta.get(f"{arch}.{name}")
        if found is None and default is None:
            raise ValueError(f"{arch} GGUF without {arch}.{name}")
        return default if found is None else found

    _refuse_unread(arch, meta)
    layers = _int(key("block_count")) - _int(key("nextn_predict_layers", 0))
    heads, hidden = _int(key("attention.head_count")), _int(key("embedding_length"))
    head_dim = _int(key("attention.key_length", hidden // heads))
    if _int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{arch} GGUF: attention key and value lengths differ")
    v_heads = _int(key("ssm.time_step_rank"))
    _, tensors = read_gguf(path)
    names = {t.name for t in tensors}
    return AutoConfig.for_model(
        "qwen3_5_text",
        vocab_size=_vocab_size(meta, tensors),
        hidden_size=hidden,
        intermediate_size=_int(key("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=_int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(key("rope.freq_base", 1e4)),  # type: ignore[arg-type]
            "partial_rotary_factor": _int(key("rope.dimension_count", head_dim)) / head_dim,
        },
        layer_types=_layer_types(key, layers),
        linear_conv_kernel_dim=_int(key("ssm.conv_kernel")),
        linear_key_head_dim=_int(key("ssm.state_size")),
        linear_value_head_dim=_int(key("ssm.inner_size")) // v_heads,
        linear_num_key_heads=_int(key("ssm.group_count")),
        linear_num_value_heads=v_heads,
        tie_word_embeddings="output.weight" not in names,
        attention_bias=any(n.endswith("attn_q.bias") for n in names),
        **{TILED_FLAG: True},
        **_special_ids(meta),
    )


def _refuse_unread(arch: str, meta: dict[str, object]) -> None:
    """Rope scaling and an attention scale other than head_dim's are read by llama.cpp but not
    kept by the decoder: refused by name rather than served wrong."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise ValueError(f"{arch} GGUF with rope scaling {kind!r} is not supported")
    if meta.get(f"{arch}.attention.scale"):
        raise ValueError(f"{arch} GGUF with attention.scale is not supported")


def _layer_types(key: Callable[..., object], layers: int) -> list[str]:
    """llama.cpp's `recurrent_layers` flags (MTP blocks past the trunk dropped), else every
    `full_attention_interval`-th layer full (default 4)."""
    flags = key("attention.recurrent_layers", [])
    if isinstance(flags, list) and flags:
        return [_LINEAR if f else "full_attention" for f in flags[:layers]]
    n = _int(key("full_attention_interval", 4))
    return [_LINEAR if (i + 1) % n else "full_attention" for i in range(layers)]


def _vocab_size(meta: dict[str, object], tensors: list[GgufTensorInfo]) -> int:
    found = meta.get(f"{meta['general.architecture']}.vocab_size")
    if found is not None:
        return _int(found)
    embed = next(t for t in tensors if t.name == "token_embd.weight")
    return int(embed.data.shape[0])


def _special_ids(meta: dict[str, object]) -> dict[str, int]:
    names = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    ids = {field: meta.get(f"tokenizer.ggml.{k}_token_id") for field, k in names.items()}
    return {field: _int(v) for field, v in ids.items() if v is not None}


def _int(value: object) -> int:
    return int(value)  # type: ignore[call-overload]
