"""The layer stack as one native call for decode and verify forwards (csrc/layers.cpp).

Between its kernels, a decode step of the Python layer loop spends ~150 µs a layer in Python
and torch's dispatcher (module calls, kernel selection, casts, views): ~3.5 ms of the bundled
0.5B draft's 21 ms step and ~4 ms of the 1.5B target's 62. `DecoderStack` runs the same ops
(the same entry points, the same roundings, so bit for bit the same result) in one C++ loop.

It applies where every one of them would run natively anyway: a CPU model whose linear layers
are all GGUF blocks on the native kernels (`quantization: gguf`), no tensor parallelism, no q/k
norm nor any of Gemma's switches, every layer rotating (not SmolLM3's), no residual multiplier
(Granite's; its other constants act outside the layers, or are the attention scale it is given),
and a forward of short queries only (decodes and verify queries, `AttentionMetadata.short_only`)
in a dtype the fused ops and the attention kernel take. Prompt chunks, other devices, compiled
graphs and forwards where a chunk would take the dense prefill GEMM keep the Python loop.
`SPECSERVE_DECODER_STACK=0` turns it off.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from engine.kernels import attention_ops, fused_ops
from engine.model.attention import AttentionMetadata
from engine.model.norms import RMSNorm
from engine.model.quant.linear import QuantLinear
from engine.model.quant.native import GgufKernel, native_chunk_limit

if TYPE_CHECKING:
    from engine.model.decoder import DecoderLayer, DecoderModel, KVCache

log = logging.getLogger("specserve.engine")

# read once; benchmarks flip it to compare the two loops in one process
ENABLED = os.environ.get("SPECSERVE_DECODER_STACK", "1") not in ("0", "false", "off")


class NativeStack:
    """DecoderModel.run_layers for short-query forwards, as one call into csrc/layers.cpp."""

    def __init__(self, model: DecoderModel) -> None:
        s = model.shape
        tensors, layout = _flatten(model)
        self.dtype = model.norm.weight.dtype
        self.stack = torch.classes.specserve_kernels.DecoderStack(
            tensors, layout, model.norm.weight, s.rms_norm_eps, s.num_heads, s.num_kv_heads,
            s.head_dim, s.attention_scale,
        )  # fmt: skip

    def accepts(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        if not ENABLED or torch.compiler.is_compiling() or x.dtype != self.dtype:
            return False
        if not meta.short_only or meta.groups[0].start_pos is None:
            return False
        return meta.groups[0].max_query_len < native_chunk_limit(x.dtype)  # no row runs dense

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embedded tokens
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin [num_tokens, 1, head_dim]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: the final norm's output
        group = meta.groups[0]
        out: torch.Tensor = self.stack.forward(
            x, *rope, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
            group.block_tables, group.start_pos, group.query_lens,
        )  # fmt: skip
        return out


def build(model: DecoderModel) -> NativeStack | None:
    """The native stack for a loaded model, or None where it does not apply."""
    s = model.shape
    if not (ENABLED and _library_has_stack()) or s.qk_norm or s.norm_offset:
        return None  # layers.cpp has Llama's layer only: no q/k norms, Gemma's norms or windows
    if not s.layers_alike or s.residual_multiplier != 1.0 or s.sandwich_norms:
        return None  # nor layers of two kinds (Gemma 3, SmolLM3), Granite's residual scaling
        # or norms after the sublayers (GLM-4, OLMo 2)
    if model.norm.weight.device.type != "cpu" or model.norm.weight.dtype not in (
        torch.float32,
        torch.bfloat16,
    ):
        return None
    if s.head_dim not in attention_ops.SIMD_HEAD_DIMS or not attention_ops.available():
        return None
    if not all(_gguf_only(linear) for layer in _layers(model) for linear in _linears(layer)):
        return None
    log.info(
        "decode and verify forwards: %d layers in one native call (DecoderStack)", s.num_layers
    )
    return NativeStack(model)


def _library_has_stack() -> bool:
    if not fused_ops.loaded():
        return False
    try:
        torch.classes.specserve_kernels.DecoderStack  # noqa: B018 (a lookup that raises if absent)
    except (AttributeError, RuntimeError):
        return False
    return True


def _layers(model: DecoderModel) -> list[DecoderLayer]:
    return list(model.layers)  # type: ignore[arg-type]


def _linears(layer: DecoderLayer) -> list[torch.nn.Module]:
    attn, mlp = layer.self_attn, layer.mlp
    assert not isinstance(mlp.down_proj, torch.Tensor)  # an MLP's: build() refused routed experts
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _gguf_only(linear: torch.nn.Module) -> bool:
    return (
        isinstance(linear, QuantLinear)
        and bool(linear.kernels)
        and all(isinstance(k, GgufKernel) for k in linear.kernels)
    )


def _flatten(model: DecoderModel) -> tuple[list[torch.Tensor], list[int]]:
    """What DecoderStack reads (layers.cpp `Reader`): per layer its two norms' weights, then per
    linear layer its kernels' blocks and bias in `tensors`, and their count, qtypes and a
    has-bias flag in `layout`."""
    tensors: list[torch.Tensor] = []
    layout: list[int] = []
    for layer in _layers(model):
        assert isinstance(layer.input_layernorm, RMSNorm)  # build() took pre-norm layers only
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        tensors += [norm.detach() for norm in norms]
        for linear in _linears(layer):
            assert isinstance(linear, QuantLinear)
            layout.append(len(linear.kernels))
            for kernel in linear.kernels:
                assert isinstance(kernel, GgufKernel)
                layout.append(kernel.qtype)
                tensors.append(kernel.blocks)
            layout.append(int(linear.bias is not None))
            if linear.bias is not None:
                tensors.append(linear.bias.detach())
    return tensors, layout
