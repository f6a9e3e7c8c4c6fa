"""Swap a decoder's linear and embedding layers for quantized ones, and say what a model runs as."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.config import Quantization
from engine.model.decoder import DecoderModel
from engine.model.quant.linear import QuantEmbedding, QuantizeMode, QuantLinear
from engine.model.quant.native import GgufKernel


def quantize_mode(quantization: Quantization, from_gguf: bool) -> QuantizeMode | None:
    """How layers take their weights; None: plain nn.Linear (`none`, or `auto` on a float
    checkpoint). `gguf` arrives only where load_model found a .gguf file and the native kernels."""
    if quantization == "none" or (quantization in ("auto", "gguf") and not from_gguf):
        return None
    if quantization in ("w8a8", "w8a8-fast", "gguf"):  # w8a8*: the modes of ACTIVATION_PASSES
        return quantization  # w8a8*: any checkpoint; every matrix int8 per row, int8 activations
    if quantization == "auto" or from_gguf:
        return "keep"  # a GGUF's quantized tensors are kept as the file has them
    return quantization


def swap_in_quantized(
    model: DecoderModel, mode: QuantizeMode, dtype: torch.dtype, device: torch.device
) -> None:
    """Replace every nn.Linear and nn.Embedding (on the meta device, before weights load)."""
    tied = model.lm_head is None
    for name, module in list(model.named_modules()):
        new: nn.Module
        if isinstance(module, nn.Linear):
            sizes = model.shard_sizes(name)
            bias = module.bias is not None
            new = QuantLinear(sizes, module.in_features, bias, mode, dtype, device)
        elif isinstance(module, nn.Embedding):
            v, d = module.num_embeddings, module.embedding_dim
            # only the token table is ever the head (not Gemma 4's per-layer table)
            new = QuantEmbedding(v, d, tied and name == "embed_tokens", mode, dtype, device)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)


@dataclass(frozen=True)
class WeightSummary:
    label: str  # formats by share of bytes, e.g. "int4-g32 + int8 + bf16"
    weight_bytes: int  # weights as held in memory (packed kernels, tables, dense params)


def summarize(model: nn.Module) -> WeightSummary:
    by_format: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()  # (address, bytes): a tied tensor once; views of one
    # buffer (pack_on_huge_pages) each

    def add(fmt: str, tensors: list[torch.Tensor]) -> None:
        fresh = [t for t in tensors if (t.data_ptr(), t.nbytes) not in seen]
        seen.update((t.data_ptr(), t.nbytes) for t in fresh)
        by_format[fmt] = by_format.get(fmt, 0) + sum(t.nbytes for t in fresh)

    for module in model.modules():
        if isinstance(module, QuantLinear):
            for fmt, kernel in zip(module.formats, module.kernels, strict=True):
                add(fmt, kernel.tensors())
                by_format[fmt] += getattr(kernel, "packed_bytes", 0)  # held outside torch
        elif isinstance(module, QuantEmbedding):
            add(module.format, module.tensors())
            by_format[module.format] += getattr(module.head, "packed_bytes", 0)
    for param in model.parameters():
        if param.dim() == 2:  # matrices name a format; norms and biases do not
            add(str(param.dtype).removeprefix("torch.").replace("bfloat16", "bf16"), [param])
        else:
            add("", [param])
    total = sum(by_format.values())
    shown = sorted((f for f in by_format if f and by_format[f]), key=lambda f: -by_format[f])
    return WeightSummary(" + ".join(shown) or "none", total)


def gguf_kernels(model: nn.Module) -> list[GgufKernel]:
    """Every GGUF-block kernel of the model's quantized linear layers (the head's too)."""
    return [
        kernel
        for module in model.modules()
        if isinstance(module, QuantLinear)
        for kernel in module.kernels
        if isinstance(kernel, GgufKernel)
    ]
