"""Tiny Gemma 4 GGUF files written as llama.cpp's converter writes them (conversion/gemma.py,
Gemma4Model over Gemma3Model and TextModel), and transformers' Gemma 4 holding their weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf_blocks import finish
from safetensors.torch import load_file
from tiny import _gguf_tokenizer

LOCAL, FULL = "sliding_attention", "full_attention"
_BLOCK = 32  # values a Q8_0 block holds: narrower rows fall back to F16, as in the converter


def write_gemma4_gguf(path: Path, src: Path, kind: T) -> None:
    """The tiny Gemma 4 at `src` as a `gemma4` GGUF: the converter's keys (global head size and KV
    heads, the local ones as `_swa`, the window pattern, KV sharing, per-layer width, double-wide
    widths as one value a layer, both rope thetas), rope_freqs for the proportional rope, norms
    unshifted, the layer scalars as `layer_output_scale.weight`, every matrix in `kind` (F16 where
    its rows are not whole blocks)."""
    config = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "gemma4")
    _hparams(writer, config)
    _gguf_tokenizer(writer, src)  # byte-level BPE (the released files' vocabulary is `gemma4`)
    writer.add_tensor("rope_freqs.weight", _rope_freqs(config))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config["num_hidden_layers"])
    for name, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        data, raw_dtype = _stored(tensor.float().numpy(), kind)
        writer.add_tensor(_gguf_name(names, name), data, raw_dtype=raw_dtype)
    finish(writer)


def _hparams(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    types, layers = config["layer_types"], config["num_hidden_layers"]
    full = next(i for i, t in enumerate(types) if t == FULL)
    global_layer = config["per_layer_config"][str(full)]
    rope = config["rope_parameters"]
    shared = config["num_kv_shared_layers"]
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    width = config["intermediate_size"]
    double = config["use_double_wide_mlp"]
    widths = [width if i < layers - shared or not double else 2 * width for i in range(layers)]
    writer.add_feed_forward_length(widths if double else width)
    writer.add_head_count(config["num_attention_heads"])
    kv, global_kv = config["num_key_value_heads"], global_layer.get("num_key_value_heads")
    writer.add_head_count_kv([kv if t == LOCAL else global_kv for t in types] if global_kv else kv)
    writer.add_rope_freq_base(rope[FULL]["rope_theta"])
    writer.add_rope_freq_base_swa(rope[LOCAL]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(global_layer["head_dim"])
    writer.add_value_length(global_layer["head_dim"])
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern([t == LOCAL for t in types])
    writer.add_rope_dimension_count(global_layer["head_dim"])
    writer.add_rope_dimension_count_swa(config["head_dim"])


def _rope_freqs(config: dict[str, Any]) -> np.ndarray:  # [global head_dim / 2]
    """1 for each pair the proportional rope turns, 1e30 (frequency 0) for the rest."""
    full = next(i for i, t in enumerate(config["layer_types"]) if t == FULL)
    head_dim = config["per_layer_config"][str(full)]["head_dim"]
    turned = int(head_dim * config["rope_parameters"][FULL]["partial_rotary_factor"] / 2)
    return np.array([1.0] * turned + [1e30] * (head_dim // 2 - turned), dtype=np.float32)


def _gguf_name(names: gguf.TensorNameMap, name: str) -> str:
    if name.endswith("layer_scalar"):  # the converter's filter_tensors adds the `.weight`
        return f"{names.get_name(name)}.weight"
    base, suffix = name.rsplit(".", 1)
    return f"{names.get_name(base)}.{suffix}"


def _stored(array: np.ndarray, kind: T) -> tuple[np.ndarray, T | None]:
    """(values, None) or (blocks, kind): a matrix in `kind`, F16 where it cannot be, else F32."""
    if array.ndim != 2 or kind == T.F32:
        return array, None
    if array.shape[1] % _BLOCK:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, kind), kind


def gemma4_reference(path: Path, src: Path, out: Path, bf16: bool = False) -> Path:
    """transformers' Gemma 4 of `src`'s config holding the GGUF at `path`'s weights as gguf's own
    reader dequantizes them (rounded to bfloat16 with `bf16`), saved at `out` in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, model.config.num_hidden_layers)
    state = model.state_dict(keep_vars=True)  # the layer scalars are buffers, not parameters
    with torch.no_grad():
        for name in load_file(str(src / "model.safetensors")):
            param, t = state[name], tensors[_gguf_name(names, name)]
            w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            w = w.float().reshape(param.shape)
            param.copy_(w.to(torch.bfloat16).float() if bf16 else w)
    model.save_pretrained(str(out))
    return out
