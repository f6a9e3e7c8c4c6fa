"""Gemma 4's text decoder from a GGUF file (llama.cpp's `gemma4`): its config, read as llama.cpp
reads it.

transformers' GGUF reader knows `gemma4` by name only: it reads neither the per-type head sizes
and KV heads, nor the window pattern, KV sharing, per-layer embeddings or the proportional rope.
llama.cpp's converter (conversion/gemma.py, Gemma4Model) writes them as: `attention.key_length`
the full-attention layers' head size and `key_length_swa` the local layers'; `head_count_kv` one
value a layer where the two kinds differ; `sliding_window_pattern` one flag a layer (True:
local); `feed_forward_length` one value a layer where the KV-shared layers' MLPs are double wide;
`attention.shared_kv_layers` and `embedding_length_per_layer_input`; `rope.freq_base` the global
layers' theta and `rope.freq_base_swa` the local layers'. The proportional rope's share is a
tensor, `rope_freqs`: one factor a rotated pair of a global head, 1 for the first
`head_dim * partial_rotary_factor / 2` pairs, 1e30 (frequency 0: unrotated) for the rest. Values
from the key projection (`attention_k_eq_v`) are a full-attention layer without `attn_v`, as
llama.cpp's loader takes them. Norms are stored as transformers holds them (no + 1, unlike
Gemma 3). The MoE block (26B-A4B) is refused, as for safetensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PretrainedConfig

from engine.model.quant.gguf_file import GgufTensorInfo, read_gguf

LOCAL, FULL = "sliding_attention", "full_attention"
_UNROTATED = 1e30  # the converter's factor for a pair the proportional rope leaves in place
_THETA = 10_000.0
_Key = Callable[..., object]  # a `gemma4.*` metadata value, or a default


def gemma4_config(path: Path, meta: dict[str, object]) -> PretrainedConfig:
    """Gemma4TextConfig from llama.cpp's `gemma4.*` keys and the file's tensor shapes."""
    from transformers import Gemma4TextConfig

    _, tensors = read_gguf(path)
    by_name = {t.name: t for t in tensors}

    def key(name: str, default: object = None) -> object:
        found = meta.get(f"gemma4.{name}")
        return default if found is None else found

    _refuse_experts(by_name)
    layers = _int(key("block_count"))
    types = _layer_types(key("attention.sliding_window_pattern"), layers)
    shared = _int(key("attention.shared_kv_layers", 0))
    width, double_wide = _mlp_width(key("feed_forward_length"), layers, shared)
    local_kv, global_kv = _kv_heads(key("attention.head_count_kv"), types)
    head_dim, global_head_dim = _head_dims(key)
    per_layer = _int(key("embedding_length_per_layer_input", 0))
    global_layer = {"head_dim": global_head_dim, "num_key_value_heads": global_kv}
    extra: dict[str, Any] = {  # keywords Gemma4TextConfig takes beside its fields
        "per_layer_config": {i: dict(global_layer) for i, kind in enumerate(types) if kind == FULL},
        **_special_ids(meta),
    }
    return Gemma4TextConfig(
        vocab_size=_rows(by_name["token_embd.weight"]),
        hidden_size=_int(key("embedding_length")),
        intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=_int(key("attention.head_count")),
        num_key_value_heads=local_kv,
        head_dim=head_dim,
        attention_k_eq_v=_k_is_v(by_name, types, shared),
        layer_types=types,
        sliding_window=_int(key("attention.sliding_window")),
        max_position_embeddings=_int(key("context_length")),
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        final_logit_softcapping=_f32_or_none(key("final_logit_softcapping")),
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=_rows(by_name["per_layer_token_embd.weight"])
        if per_layer
        else 0,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double_wide,
        rope_parameters=_rope(key, by_name, head_dim, global_head_dim),
        tie_word_embeddings="output.weight" not in by_name,
        **extra,
    )


def _int(value: object) -> int:
    return int(str(value))


def _f32(value: object) -> float:
    """A float32 key as the decimal it was written from (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(str(value))))


def _f32_or_none(value: object) -> float | None:
    return None if value is None else _f32(value)


def _rows(tensor: GgufTensorInfo) -> int:
    return int(tensor.data.shape[0])


def _refuse_experts(tensors: dict[str, GgufTensorInfo]) -> None:
    if any(name.endswith("ffn_gate_inp.weight") for name in tensors):
        raise ValueError("Gemma 4 GGUF with experts (26B-A4B's MoE block): not supported")


def _layer_types(pattern: object, layers: int) -> list[str]:
    """llama.cpp requires the pattern as one flag a layer (True: local)."""
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(f"Gemma 4 GGUF: sliding_window_pattern {pattern!r}, not {layers} flags")
    return [LOCAL if flag else FULL for flag in pattern]


def _mlp_width(value: object, layers: int, shared: int) -> tuple[int, bool]:
    """(intermediate_size, use_double_wide_mlp): the array the converter writes for double-wide
    MLPs has the KV-shared layers at twice the others' width, and nothing else differs."""
    if not isinstance(value, list):
        return _int(value), False
    widths = [_int(v) for v in value]
    first_shared = layers - shared
    doubled = [widths[0]] * first_shared + [2 * widths[0]] * shared
    if widths not in ([widths[0]] * layers, doubled):
        raise ValueError(f"Gemma 4 GGUF: per-layer feed_forward_length {widths} not supported")
    return widths[0], widths != [widths[0]] * layers


def _kv_heads(value: object, types: list[str]) -> tuple[int, int]:
    """(local layers' KV heads, global layers'): one value, or one a layer, uniform by kind."""
    if not isinstance(value, list):
        return _int(value), _int(value)
    by_kind = {
        kind: {_int(v) for v, t in zip(value, types, strict=True) if t == kind}
        for kind in (LOCAL, FULL)
    }
    if any(len(heads) > 1 for heads in by_kind.values()):
        raise ValueError(f"Gemma 4 GGUF: head_count_kv {value} varies within a kind of layer")
    full = by_kind[FULL].pop()
    return (by_kind[LOCAL].pop() if by_kind[LOCAL] else full), full


def _head_dims(key: _Key) -> tuple[int, int]:
    """(local head size, global head size); llama.cpp refuses values of another size than keys."""
    full, local = _int(key("attention.key_length")), _int(key("attention.key_length_swa"))
    values = (key("attention.value_length", full), key("attention.value_length_swa", local))
    if (_int(values[0]), _int(values[1])) != (full, local):
        raise ValueError("Gemma 4 GGUF: value heads of another size than key heads")
    return local, full


def _k_is_v(tensors: dict[str, GgufTensorInfo], types: list[str], shared: int) -> bool:
    """Whether the full-attention layers take their values from the key projection: those that
    compute K/V have no attn_v (local layers always have theirs)."""
    own_kv = range(len(types) - shared)
    without_v = {i for i in own_kv if f"blk.{i}.attn_v.weight" not in tensors}
    full = {i for i in own_kv if types[i] == FULL}
    if without_v - full or (without_v and without_v != full):
        raise ValueError(f"Gemma 4 GGUF: layers {sorted(without_v)} lack attn_v")
    return bool(without_v)


def _rope(
    key: _Key, tensors: dict[str, GgufTensorInfo], head_dim: int, global_head_dim: int
) -> dict[str, dict[str, object]]:
    """The local layers' default rope and the global layers' proportional one, its share from the
    rope_freqs factors; any other rotated width, scaling or factor is refused."""
    rotated = (
        _int(key("rope.dimension_count_swa", head_dim)),
        _int(key("rope.dimension_count", global_head_dim)),
    )
    if rotated != (head_dim, global_head_dim) or key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"Gemma 4 GGUF: rope over {rotated} dims or scaled: not supported")
    theta = _f32(key("rope.freq_base", _THETA))  # llama.cpp's defaults, both
    return {
        FULL: {
            "rope_type": "proportional",
            "partial_rotary_factor": _rotated_share(
                tensors.get("rope_freqs.weight"), global_head_dim
            ),
            "rope_theta": theta,
        },
        LOCAL: {
            "rope_type": "default",
            "rope_theta": _f32(key("rope.freq_base_swa", _THETA)),
        },
    }


def _rotated_share(factors: GgufTensorInfo | None, global_head_dim: int) -> float:
    if factors is None:  # no factors: every pair rotates
        return 1.0
    values = np.asarray(factors.data, dtype=np.float64).reshape(-1)
    rotated = int((values == 1.0).sum())
    if (
        len(values) != global_head_dim // 2
        or (values[:rotated] != 1.0).any()
        or (values[rotated:] < _UNROTATED).any()
    ):
        raise ValueError("Gemma 4 GGUF: rope_freqs other than 1 then 1e30 (proportional rope)")
    return 2 * rotated / global_head_dim


def _special_ids(meta: dict[str, object]) -> dict[str, int]:
    names = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    ids = {field: meta.get(f"tokenizer.ggml.{k}_token_id") for field, k in names.items()}
    return {field: _int(v) for field, v in ids.items() if v is not None}
