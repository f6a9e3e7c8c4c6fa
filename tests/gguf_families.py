"""Tiny dense-family models written as GGUF files the way llama.cpp's converter writes them
(conversion/{phi,granite,llama,olmo,glm}.py: its tensor names, metadata keys and q/k layouts), and
transformers references holding the same weights as gguf's own reader dequantizes them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from tiny import _gguf_hparams, _gguf_tokenizer

# the model_type of each tiny family -> llama.cpp's architecture
ARCH = {
    "phi3": gguf.MODEL_ARCH.PHI3,
    "granite": gguf.MODEL_ARCH.GRANITE,
    "smollm3": gguf.MODEL_ARCH.SMOLLM3,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "glm4": gguf.MODEL_ARCH.GLM4,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}
_LLAMA_PERMUTED = ("granite", "smollm3")  # LlamaModel subclasses: undo_permute = True


def write_family_gguf(path: Path, src: Path, kind: T) -> None:
    """The tiny model at `src` as its family's converter lays it out, every matrix in `kind` (F32,
    or quantized by gguf's own reference), vectors in F32."""
    from safetensors.torch import load_file

    config = json.loads((src / "config.json").read_text())
    family = config["model_type"]
    arch = ARCH[family]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _gguf_hparams(writer, config)
    _METADATA[family](writer, config)
    _gguf_tokenizer(writer, src)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        base, suffix = name.rsplit(".", 1)
        array = _as_converted(family, config, name, tensor.float()).numpy()
        target = f"{names.get_name(base)}.{suffix}"
        if array.ndim == 2 and kind != T.F32:
            writer.add_tensor(target, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(target, array)
    for name, array in _extra_tensors(family, config):
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def family_reference(src: Path, kind: T, out: Path, bf16: bool = False) -> Path:
    """transformers' model of `src` with every matrix as gguf dequantizes it in `kind` (rows are
    quantized in blocks along the row, so a fused or permuted matrix rounds as its parts), every
    tensor rounded to bfloat16 with `bf16` (as a conversion to bf16 safetensors stores it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            w = param.detach().numpy()
            if w.ndim == 2 and kind != T.F32:
                w = gguf.quants.dequantize(gguf.quants.quantize(w, kind), kind)
            value = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(param.shape)
            param.copy_(value.to(torch.bfloat16).float() if bf16 else value)
    model.save_pretrained(str(out))
    return out


def _as_converted(family: str, config: dict[str, Any], name: str, t: torch.Tensor) -> torch.Tensor:
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if family in _LLAMA_PERMUTED and name.endswith("q_proj.weight"):
        return _llama_permute(t, heads)
    if family in _LLAMA_PERMUTED and name.endswith("k_proj.weight"):
        return _llama_permute(t, kv_heads)
    if family == "glm4" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                           "k_proj.bias")):  # fmt: skip
        return _glm4_normal_to_neox(t, config)
    return t


def _llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rotary pairs interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _glm4_normal_to_neox(w: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """llama.cpp's Glm4Model.normal_to_neox: each head's interleaved rotary dims as two halves."""
    head_dim = config["head_dim"]
    rotary = int(head_dim * config.get("partial_rotary_factor", 0.5))
    heads = w.reshape(w.shape[0] // head_dim, head_dim, -1)
    rot, passed = heads[:, :rotary], heads[:, rotary:]
    return torch.cat([rot[:, ::2], rot[:, 1::2], passed], dim=1).reshape(w.shape)


def _phi3(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    rope = config["rope_parameters"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    original = rope.get("original_max_position_embeddings", config["max_position_embeddings"])
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = config["max_position_embeddings"] / original
        factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(factor)


def _extra_tensors(family: str, config: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    rope = config.get("rope_parameters", {})
    if family != "phi3" or rope.get("rope_type") != "longrope":
        return []
    return [
        ("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)),
        ("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)),
    ]


def _llama_like(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["head_dim"])


def _granite(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """GraniteModel: head_dim popped (hidden / heads), the multipliers as scales."""
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_attention_scale(config["attention_multiplier"])
    writer.add_embedding_scale(config["embedding_multiplier"])
    writer.add_residual_scale(config["residual_multiplier"])
    writer.add_logit_scale(config["logits_scaling"])


def _with_head_dim(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])


def _glm4(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    _with_head_dim(writer, config)
    rotated = int(config["head_dim"] * config.get("partial_rotary_factor", 0.5))
    writer.add_rope_dimension_count(rotated)


_METADATA = {
    "phi3": _phi3,
    "granite": _granite,
    "smollm3": lambda w, c: (_llama_like(w, c), _with_head_dim(w, c)),
    "olmo2": _with_head_dim,
    "glm4": _glm4,
    "qwen3": _with_head_dim,
}
