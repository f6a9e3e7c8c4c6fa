"""The layer stack as one native call for decode and verify forwards (csrc/layers.cpp).

Between its kernels, a decode step of the Python layer loop spends ~150 µs a layer in Python
and torch's dispatcher (module calls, kernel selection, casts, views): ~3.5 ms of the bundled
0.5B draft's 21 ms step and ~4 ms of the 1.5B target's 62. `DecoderStack` runs the same ops
(the same entry points, the same roundings, so bit for bit the same result) in one C++ loop.

It applies where every one of them would run natively anyway: a CPU model whose linear layers
are all GGUF blocks on the native kernels (`quantization: gguf`), no tensor parallelism, Llama's
layer (no q/k norm, no norm after a sublayer, every layer rotating: not SmolLM3's; no residual
multiplier: Granite's other constants act outside the layers, or are the attention scale it is
given) or Gemma 3's (offset norms, q/k norms, sandwich norms, GeGLU, local layers with their own
rope and a window: the native ops of engine/kernels/gemma_ops.py, which the Python loop calls
too), and a forward of short queries only (decodes and verify queries, a draft tree's too on
Llama's layer: the kernel takes its rows' bits; `AttentionMetadata.short_only`) in a dtype the
fused ops and the attention kernel take. Prompt chunks, other devices, compiled graphs and
forwards where a chunk would take the dense prefill GEMM keep the Python loop.
`SPECSERVE_DECODER_STACK=0` turns it off.

For an EAGLE-3 head it also keeps the streams entering the head's aux layers (Llama's layer):
`__call__(..., aux_layers)` then `aux()`, the tensor run_layers would keep, bit for bit.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from engine.kernels import attention_ops, fused_ops
from engine.model.attention import AttentionMetadata
from engine.model.moe import MoE
from engine.model.norms import RMSNorm
from engine.model.quant.linear import QuantLinear
from engine.model.quant.native import GgufKernel, native_chunk_limit
from engine.model.quant.native_experts import ExpertBlocks, expert_blocks

if TYPE_CHECKING:
    from engine.model.decoder import DecoderLayer, DecoderModel, KVCache
    from engine.model.shape import DecoderShape

log = logging.getLogger("specserve.engine")

# read once; benchmarks flip it to compare the two loops in one process
ENABLED = os.environ.get("SPECSERVE_DECODER_STACK", "1") not in ("0", "false", "off")


class NativeStack:
    """DecoderModel.run_layers for short-query forwards, as one call into csrc/layers.cpp."""

    def __init__(self, model: DecoderModel) -> None:
        s = model.shape
        tensors, layout = _flatten(model)
        self.dtype = model.norm.weight.dtype
        self.windowed = any(s.is_sliding(i) for i in range(s.num_layers))
        self.gemma = is_gemma(s)
        self.aux_layers: tuple[int, ...] = ()  # the ones the native call keeps now
        sliding = [int(s.is_sliding(i)) for i in range(s.num_layers)]
        self.stack = torch.classes.specserve_kernels.DecoderStack(
            tensors, layout, model.norm.weight, s.rms_norm_eps, s.num_heads, s.num_kv_heads,
            s.head_dim, s.attention_scale, self.gemma, sliding, s.sliding_window or 0,
        )  # fmt: skip

    def accepts(
        self, x: torch.Tensor, meta: AttentionMetadata, aux_layers: tuple[int, ...] = ()
    ) -> bool:
        if not ENABLED or torch.compiler.is_compiling() or x.dtype != self.dtype:
            return False
        if aux_layers and self.gemma:
            return False
        if not meta.short_only or meta.groups[0].start_pos is None:
            return False
        if self.windowed and (meta.sliding is None or meta.sliding.groups[0].start_pos is None):
            return False
        if self.gemma and meta.groups[0].tree_bits is not None:
            return False  # models with windows draft no trees: Gemma's path takes none
        return meta.groups[0].max_query_len < native_chunk_limit(x.dtype)  # no row runs dense

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embedded tokens
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, signed sin [num_tokens, 1, head_dim]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # the sliding layers'
        aux_layers: tuple[int, ...] = (),  # streams to keep for aux()
    ) -> torch.Tensor:  # [num_tokens, hidden]: the final norm's output
        if aux_layers != self.aux_layers:
            self.stack.keep_aux(list(aux_layers))
            self.aux_layers = aux_layers
        group = meta.groups[0]
        local = meta.sliding.groups[0] if meta.sliding is not None else group
        out: torch.Tensor = self.stack.forward(
            x, *rope, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
            group.block_tables, group.start_pos, group.query_lens, *(local_rope or rope),
            local.block_tables, group.tree_bits,
        )  # fmt: skip
        return out

    def aux(self) -> torch.Tensor:  # [num_tokens, n * hidden]: the last call's kept streams
        kept: torch.Tensor = self.stack.aux()
        return kept


def build(model: DecoderModel) -> NativeStack | None:
    """The native stack for a loaded model, or None where it does not apply."""
    s = model.shape
    if not (ENABLED and _library_has_stack()) or not (is_llama(s) or is_gemma(s)):
        return None
    if model.norm.weight.device.type != "cpu" or model.norm.weight.dtype not in (
        torch.float32,
        torch.bfloat16,
    ):
        return None
    if s.head_dim not in attention_ops.SIMD_HEAD_DIMS or not attention_ops.available():
        return None
    if not all(_gguf_only(linear) for layer in _layers(model) for linear in _linears(layer)):
        return None
    if not all(_experts(layer) is not None for layer in _layers(model) if _routed(layer)):
        return None
    log.info(
        "decode and verify forwards: %d layers in one native call (DecoderStack)", s.num_layers
    )
    return NativeStack(model)


def is_llama(s: DecoderShape) -> bool:
    """Llama's layer as layers.cpp computes it: no Gemma's norms or windows, layers of one kind
    (not SmolLM3's), no residual scaling (Granite's), no norms after the sublayers (GLM-4, OLMo
    2), no sinks; Qwen3's q/k norms over each head, and Qwen3-MoE's routed MLPs, allowed."""
    plain = not (s.norm_offset or s.sandwich_norms or s.attention_sinks or s.norm_late_round)
    plain = plain and s.activation == "silu" and not (s.v_norm or s.layer_scalar)  # Gemma 4's
    plain = plain and s.global_head_dim is None and not s.o_bias
    qk = not s.qk_norm or not s.qk_norm_flat
    one_kind = not s.layer_types and not s.no_rope_layers and s.pre_norms
    return plain and qk and one_kind and s.residual_multiplier == 1.0 and _plain_moe(s)


def _plain_moe(s: DecoderShape) -> bool:
    """No routed MLP, or Qwen3-MoE's (softmax then top k, no bias, SiLU experts)."""
    moe = s.moe
    if moe is None:
        return True
    return not (moe.topk_then_softmax or moe.router_bias or moe.swiglu_limit is not None)


def is_gemma(s: DecoderShape) -> bool:
    """Gemma 3's layer as layers.cpp computes it (its local layers windowed)."""
    switches = s.norm_offset and s.sandwich_norms and s.qk_norm and s.activation == "gelu_tanh"
    odd = s.qk_norm_flat or not s.pre_norms or s.attention_sinks or bool(s.no_rope_layers)
    odd = odd or s.v_norm or s.layer_scalar or s.global_head_dim is not None  # Gemma 4's
    kinds = set(s.layer_types) <= {"sliding_attention", "full_attention"}
    window = s.sliding_window is not None or "sliding_attention" not in s.layer_types
    plain = s.residual_multiplier == 1.0 and s.moe is None and not s.qkv_bias and not s.o_bias
    return bool(switches and not odd and kinds and window and plain)


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


def _routed(layer: DecoderLayer) -> bool:
    return isinstance(layer.mlp, MoE)


def _linears(layer: DecoderLayer) -> list[torch.nn.Module]:
    """The layer's linear layers but a routed MLP's experts (`_experts`)."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, MoE):
        return [attn.qkv_proj, attn.o_proj]
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _experts(layer: DecoderLayer) -> ExpertBlocks | None:
    assert isinstance(layer.mlp, MoE)
    return expert_blocks(layer.mlp.experts) if layer.mlp.silu_experts else None


def _gguf_only(linear: torch.nn.Module) -> bool:
    return (
        isinstance(linear, QuantLinear)
        and bool(linear.kernels)
        and all(isinstance(k, GgufKernel) for k in linear.kernels)
    )


def _flatten(model: DecoderModel) -> tuple[list[torch.Tensor], list[int]]:
    """What DecoderStack reads (layers.cpp `Reader`): per layer its flags in `layout` (q/k
    norms, routed), its norms' weights, then per linear layer its kernels' blocks and bias in
    `tensors`, and their count, qtypes and a has-bias flag in `layout`; a routed layer's router
    and experts (`_flatten_routed`) in place of gate_up and down."""
    tensors: list[torch.Tensor] = []
    layout: list[int] = []
    gemma = is_gemma(model.shape)
    for layer in _layers(model):
        assert isinstance(layer.input_layernorm, RMSNorm)  # build() took pre-norm layers only
        attn = layer.self_attn
        qk_norm = attn.q_norm is not None and not gemma
        layout.append(_QK_NORM * qk_norm + _ROUTED * _routed(layer))
        norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if attn.q_norm is not None and attn.k_norm is not None:  # Gemma's or Qwen3's
            norms += [attn.q_norm.weight, attn.k_norm.weight]
        if gemma:  # then the feedforward's pre and post norms
            assert isinstance(layer.pre_feedforward_layernorm, RMSNorm)
            assert layer.post_feedforward_layernorm is not None
            norms += [
                layer.pre_feedforward_layernorm.weight,
                layer.post_feedforward_layernorm.weight,
            ]
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
        if isinstance(layer.mlp, MoE):
            _flatten_routed(layer.mlp, tensors, layout)
    return tensors, layout


# layers.cpp's layer flags
_QK_NORM, _ROUTED = 1, 2


def _flatten_routed(mlp: MoE, tensors: list[torch.Tensor], layout: list[int]) -> None:
    blocks = expert_blocks(mlp.experts)
    assert blocks is not None  # build() checked
    router = mlp.gate
    tensors += [router.weight.detach(), *blocks.gate_up, *blocks.down]
    layout += [router.top_k, int(router.norm_topk_prob), len(blocks.gate_up)]
    layout += [blocks.gate_up_qtype, blocks.down_qtype]
