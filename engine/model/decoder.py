"""The decoder-only family: Llama 2/3, Qwen2/2.5, Qwen3, Mistral, SmolLM 1-3, Gemma 3, Phi-3/4,
Granite.

One module covers them all: RMSNorm, RoPE (engine.model.rope), grouped-query attention with
optional QKV bias (Qwen2) and q/k RMSNorm (Qwen3, Gemma 3), a gated MLP, tied or untied
embeddings. Gemma 3 is the same decoder with switches on (`DecoderShape`): norms that scale by
1 + weight, a GeGLU MLP, a norm after each sublayer too, scaled embeddings, its own attention
scale, and local layers with a sliding window and a rope of their own. Granite scales the
embeddings, the attention, each sublayer's output and the logits by constants of its config;
SmolLM3 leaves some layers unrotated (NoPE); Qwen3-MoE routes each token to a few experts, each
this module's gated MLP (engine.model.moe). It runs over a flat
ragged batch (`input_ids [T]`, `positions [T]`) with paged KV caches described by one
`AttentionMetadata`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Protocol, Union, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.kernels import fused_ops, gemma_ops
from engine.model.attention import AttentionMetadata, attend, paged_attention
from engine.model.moe import ClampedSwiGLUExpert, MoE
from engine.model.norms import FlatNorm, NoNorm, RMSNorm, UnitNorm
from engine.model.quant.formats import QuantizedWeight
from engine.model.rope import Rope, Rotary, apply_rope, rope_layer_types
from engine.model.shape import DecoderShape

if TYPE_CHECKING:
    from engine.model.quant.gguf_weights import GgufRows

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V: [kv_heads, num_blocks, block_size, dim]
# a checkpoint tensor, or a GGUF's quantized one (engine.model.quant): kept quantized, or left in the file
WeightValue = Union[torch.Tensor, QuantizedWeight, "GgufRows"]


def silu_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]: dtype, or float32 before rounding
    dtype: torch.dtype,  # the model's: where the eager ops round
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [num_tokens, intermediate]: silu(gate) * up
    if not torch.compiler.is_compiling() and fused_ops.usable(gate_up):
        if dtype in (torch.float32, torch.bfloat16):
            return fused_ops.silu_mul(gate_up, dtype, out_dtype)
    return fused_ops.silu_mul_reference(gate_up, dtype, out_dtype)


def gelu_tanh_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]: dtype, or float32 before rounding
    dtype: torch.dtype,  # the model's: where the eager ops round
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [num_tokens, intermediate]: gelu_tanh(gate) * up (Gemma's GeGLU)
    if dtype in (torch.float32, torch.bfloat16) and gemma_ops.usable(gate_up):
        return gemma_ops.gelu_tanh_mul(gate_up, dtype, out_dtype)  # the native stack's own op
    return gemma_ops.gelu_tanh_mul_reference(gate_up, dtype, out_dtype)


_GATED = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


def gemm_input_dtype(linear: nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype a linear layer reads without a cast: float32 for the GGUF kernels
    (QuantLinear.input_dtype), else the model's."""
    found: torch.dtype | None = getattr(linear, "input_dtype", None)
    return found or dtype


def gemm_unrounded(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
    """A linear layer's output before it is rounded to the model dtype, where it has one
    (QuantLinear.unrounded: float32 from the GGUF kernels); else its plain output."""
    unrounded = getattr(linear, "unrounded", None)
    if unrounded is None or getattr(linear, "bias", None) is not None:
        return linear(x)
    return unrounded(x)


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape, sliding: bool = False, rotates: bool = True) -> None:
        super().__init__()
        self.shape = shape
        self.sliding = sliding  # reads the forward through `meta.sliding`: keys in its window
        self.rotates = rotates  # False: no rotary embedding (SmolLM3's NoPE layers)
        out = shape.q_size + 2 * shape.kv_size
        self.qkv_proj = nn.Linear(shape.hidden_size, out, bias=shape.qkv_bias)
        # nn.Module: quantization and tensor parallelism swap the row-parallel projections
        self.o_proj: nn.Module = nn.Linear(shape.q_size, shape.hidden_size, bias=shape.o_bias)
        norms = _qk_norms(shape) if shape.qk_norm else (None, None)
        self.q_norm: RMSNorm | None = norms[0]
        self.k_norm: RMSNorm | None = norms[1]
        self.v_norm = UnitNorm(shape.rms_norm_eps) if shape.v_norm else None  # Gemma 4's
        self.scale = shape.attention_scale
        # gpt-oss's: per head, the logit of a key every query sees whose value is zero
        self.sinks = nn.Parameter(torch.empty(shape.num_heads)) if shape.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: the model dtype, or float32 before rounding to it
        s = self.shape
        if self.sliding:
            assert meta.sliding is not None, "a sliding-window model's metadata lacks its window"
            meta = meta.sliding
        if not self.rotates:  # cos 1, sin 0: q and k pass unchanged, exactly, on either path
            rope = (torch.ones_like(rope[0]), torch.zeros_like(rope[1]))
        qk, v = self.qkv_proj(x).split([s.q_size + s.kv_size, s.kv_size], dim=-1)
        qk = qk.view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.v_norm is not None:
            v = self.v_norm(v)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if fused_ops.rope_kv_usable(qk, kv_cache[0]):  # rotate and write K/V in one pass
            q = fused_ops.rope_write_kv(qk, v, *rope, *kv_cache, meta.slot_mapping, s.num_heads)
            out = attend(q, kv_cache[0], kv_cache[1], meta, self.scale, self.sinks)
        else:
            q, k = apply_rope(qk, *rope).split([s.num_heads, s.num_kv_heads], dim=1)
            out = paged_attention(q, k, v, *kv_cache, meta, self.scale, self.sinks)
        return gemm_unrounded(self.o_proj, out)  # the next norm rounds it


def _qk_norms(shape: DecoderShape) -> tuple[RMSNorm, RMSNorm]:
    """Per head (Qwen3's, Gemma's), or over all heads of the projection (OLMo 2's)."""
    eps, offset, late = shape.rms_norm_eps, shape.norm_offset, shape.norm_late_round or None
    if shape.qk_norm_flat:
        return FlatNorm(shape.q_size, eps, offset, late), FlatNorm(shape.kv_size, eps, offset, late)
    return RMSNorm(shape.head_dim, eps, offset, late), RMSNorm(shape.head_dim, eps, offset, late)


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.intermediate_size = shape.intermediate_size
        self.gated = _GATED[shape.activation]
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj: nn.Module = nn.Linear(
            shape.intermediate_size, shape.hidden_size, bias=False
        )

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: dtype's values (in float32 for a GGUF GEMM)
        dtype: torch.dtype,  # the model's
    ) -> torch.Tensor:  # [num_tokens, hidden]: dtype, or float32 before rounding to it
        gate_up = gemm_unrounded(self.gate_up_proj, x)  # [num_tokens, 2 * intermediate]
        act = self.gated(gate_up, dtype, gemm_input_dtype(self.down_proj, dtype))
        return gemm_unrounded(self.down_proj, act)  # the next norm rounds it


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, index: int = 0) -> None:
        super().__init__()
        late = shape.norm_late_round or None
        norm = partial(RMSNorm, shape.hidden_size, shape.rms_norm_eps, shape.norm_offset, late)
        pre_norm = norm if shape.pre_norms else NoNorm  # OLMo 2 has none before its sublayers
        self.sliding = shape.is_sliding(index)
        self.residual_multiplier = shape.residual_multiplier
        self.input_layernorm: RMSNorm | NoNorm = pre_norm()
        self.self_attn = Attention(shape.attention_shape(index), self.sliding, shape.rotates(index))
        # Llama's: the MLP's norm; with sandwich norms (Gemma's), the attention output's
        self.post_attention_layernorm = norm()
        self.mlp: MLP | MoE = _moe(shape) if shape.is_moe(index) else MLP(shape)
        self.pre_feedforward_layernorm: RMSNorm | NoNorm | None = (
            pre_norm() if shape.sandwich_norms else None
        )
        self.post_feedforward_layernorm = norm() if shape.sandwich_norms else None
        # Gemma 4's: the stream after the layer times a learned scalar
        self.layer_scalar = nn.Parameter(torch.empty(1)) if shape.layer_scalar else None

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the last sublayer's output (or the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before x; None: none
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # the MLP's output, the stream before it
        """The residual add is left to the next norm (`RMSNorm.add_forward`), which fuses it; so
        is rounding a GEMM's float32 output to the model dtype."""
        attn, mlp = self.self_attn, self.mlp
        dtype = x.dtype if residual is None else residual.dtype  # the model's
        h, residual = self.input_layernorm.add_forward(
            x, residual, gemm_input_dtype(attn.qkv_proj, dtype)
        )
        x = self._scaled(attn(h, rope, kv_cache, meta), dtype)
        if self.pre_feedforward_layernorm is not None:
            return self._scaled_stream(*self._sandwich_mlp(x, residual, dtype))
        h, residual = self.post_attention_layernorm.add_forward(
            x, residual, gemm_input_dtype(mlp.gate_up_proj, dtype)
        )
        return self._scaled(mlp(h, dtype), dtype), residual

    def _scaled(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output (float32 before rounding)
        dtype: torch.dtype,  # the model's
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Granite's residual_multiplier, on the output rounded to the model dtype as
        transformers has it; other families' outputs pass untouched (and unrounded)."""
        if self.residual_multiplier == 1.0:
            return x
        return x.to(dtype) * self.residual_multiplier

    def _scaled_stream(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the MLP's output (normed)
        residual: torch.Tensor,  # [num_tokens, hidden]: the stream before it
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gemma 4's layer scalar: the residual add done here, its sum scaled (None: no stream
        left for the next norm to add); other families' pass through."""
        if self.layer_scalar is None:
            return x, residual
        total = x.to(residual.dtype) + residual
        return total * self.layer_scalar.to(total.dtype), None

    def _sandwich_mlp(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the attention's output
        residual: torch.Tensor,  # [num_tokens, hidden]: the stream before it
        dtype: torch.dtype,  # the model's
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the MLP's output (normed), the stream before it
        """Gemma's: each sublayer's output is normed before it joins the stream."""
        assert self.pre_feedforward_layernorm is not None
        assert self.post_feedforward_layernorm is not None
        x = self.post_attention_layernorm(x.to(dtype))
        h, residual = self.pre_feedforward_layernorm.add_forward(
            x, residual, gemm_input_dtype(self.mlp.gate_up_proj, dtype)
        )
        return self.post_feedforward_layernorm(self.mlp(h, dtype).to(dtype)), residual


def _moe(shape: DecoderShape) -> MoE:
    """A routed MLP whose experts are this decoder's gated MLP at the experts' size."""
    moe = shape.moe
    assert moe is not None
    if moe.swiglu_limit is not None:  # gpt-oss's
        args = (shape.hidden_size, moe.expert_size, moe.swiglu_alpha, moe.swiglu_limit)
        return MoE(shape.hidden_size, moe, partial(ClampedSwiGLUExpert, *args))
    expert_shape = replace(shape, intermediate_size=moe.expert_size)
    silu = shape.activation == "silu"
    return MoE(shape.hidden_size, moe, partial(MLP, expert_shape), silu_experts=silu)


# transformers parameter name suffix -> (our parameter, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "gate_proj": ("gate_up_proj", 0),  # an expert's: mlp.experts.E.gate_proj
    "up_proj": ("gate_up_proj", 1),
}


class LayerStack(Protocol):
    """run_layers done elsewhere for the forwards it accepts (engine.model.decoder_stack)."""

    def accepts(
        self, x: torch.Tensor, meta: AttentionMetadata, aux_layers: tuple[int, ...] = ()
    ) -> bool: ...

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embedded tokens
        rope: Rope,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        local_rope: Rope | None = None,  # the sliding layers' (None: theirs is `rope`)
        aux_layers: tuple[int, ...] = (),  # streams to keep (an EAGLE-3 head's features)
    ) -> torch.Tensor: ...  # [num_tokens, hidden]: the final norm's output

    def aux(self) -> torch.Tensor: ...  # [num_tokens, n * hidden]: the last call's kept streams


class DecoderModel(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        late = shape.norm_late_round or None
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, shape.norm_offset, late)
        self.lm_head = (
            None
            if shape.tie_word_embeddings
            else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        )
        self.rotary: Rotary | None = None
        self.local_rotary: Rotary | None = None  # the sliding layers' when their rope differs
        # the layer stack as a compiled graph where it fits the batch (engine.model.decode_graph)
        self.compiled_layers: Callable[..., torch.Tensor] | None = None
        # the layer stack in one native call for decode and verify forwards (decoder_stack)
        self.native_stack: LayerStack | None = None
        # Layers whose input stream an EAGLE-3 head reads (j: the stream entering layer j; num_layers:
        # the last one's output before the norm), the last forward's in aux_hidden [T, n * hidden]
        # in layer order. The eager loop and the native stack keep them; no compiled graph does.
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None
        # token ids the head scores: the first head_rows, then head_extra (all of them by default)
        self.head_rows = shape.vocab_size
        self.head_extra: list[int] = []

    def limit_head(self, rows: int, extra_ids: Iterable[int] = ()) -> None:
        """Score only the first `rows` token ids and `extra_ids` (a tokenizer's stop ids, so that
        the end of an answer can still be proposed); every other id gets a -inf logit. A draft's
        cheaper head.

        BPE vocabularies number tokens in merge order, so the first ids are the common ones: the
        first 65,536 of Qwen2.5's 151,936 (and its stop ids) cover 98-99% of the bundled target's
        answers on the bench's prompts (`bench.draft_vocab`), for 43% of the head's weight bytes.
        The target verifies whatever is drafted, so a token the draft cannot propose costs
        acceptance, never correctness. Call on the meta device, before the weights load: the head
        becomes its own matrix (a tied one too)."""
        if not 0 < rows < self.shape.vocab_size:
            return
        self.head_rows = rows
        self.head_extra = sorted({i for i in extra_ids if rows <= i < self.shape.vocab_size})
        num_scored = rows + len(self.head_extra)
        self.lm_head = nn.Linear(self.shape.hidden_size, num_scored, bias=False)

    def init_rotary(self, config: PretrainedConfig, device: torch.device) -> None:
        head_dim, types = self.shape.head_dim, rope_layer_types(config)
        if not types:
            self.rotary = Rotary(config, head_dim, device)
            return
        global_head_dim = self.shape.global_head_dim or head_dim  # Gemma 4's own
        self.rotary = Rotary(config, global_head_dim, device, "full_attention")
        if "sliding_attention" in types:
            self.local_rotary = Rotary(config, head_dim, device, "sliding_attention")

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        assert self.rotary is not None, "call init_rotary first"
        x = self.embed(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        local = None  # layers of two kinds: the sliding layers' rope
        if self.shape.layer_types:
            local = (self.local_rotary or self.rotary).tables(positions, x.dtype)
        stack = self.native_stack
        if stack is not None and stack.accepts(x, meta, self.aux_layers):
            out = stack(x, rope, kv_caches, meta, local, self.aux_layers)  # Gemma 3's too
            if self.aux_layers:
                self.aux_hidden = stack.aux()
            return out
        if self.aux_layers:
            return self.run_layers(x, rope, kv_caches, meta, local)
        if local is not None:  # the eager loop picks each layer's rope
            return self.run_layers(x, rope, kv_caches, meta, local)
        run_layers = self.compiled_layers or self.run_layers
        return run_layers(x, rope, kv_caches, meta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = self.embed_tokens(input_ids)
        if self.shape.embedding_multiplier != 1.0:  # Granite's, a Python float as transformers'
            x = x * self.shape.embedding_multiplier
        if self.shape.embed_scale is None:
            return x
        # in the table's dtype, as transformers does: sqrt(3072) becomes 55.5 in bfloat16
        return x * torch.tensor(self.shape.embed_scale).to(x.dtype)

    def run_layers(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embedded tokens
        rope: Rope,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        local_rope: Rope | None = None,  # the sliding layers' (None: theirs is `rope`)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        aux: list[torch.Tensor] = []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in self.aux_layers:
                aux.append(x if residual is None else x.to(residual.dtype) + residual)
            layer_rope = local_rope if layer.sliding and local_rope is not None else rope
            x, residual = layer(x, residual, layer_rope, kv_cache, meta)
        return self.final_norm(x, residual, aux)

    def final_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, aux: list[torch.Tensor]
    ) -> torch.Tensor:  # [num_tokens, hidden] after the last layer -> the final norm's output
        """The last add and norm; the kept streams (aux_layers, in order) set as aux_hidden."""
        dtype = x.dtype if residual is None else residual.dtype
        out, stream = self.norm.add_forward(x, residual, dtype)
        if len(self.layers) in self.aux_layers:
            aux.append(stream.to(dtype))
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] fp32
        if self.lm_head is not None:
            logits = self._unscaled(self.lm_head(hidden))  # [N, head_rows + len(head_extra)]
            return logits if self.head_rows == self.shape.vocab_size else self._spread(logits)
        if isinstance(self.embed_tokens, nn.Embedding):
            return self._unscaled(F.linear(hidden, self.embed_tokens.weight))
        return self._unscaled(self.embed_tokens.attend(hidden))  # a quantized table as the head

    def _unscaled(self, logits: torch.Tensor) -> torch.Tensor:  # [N, scored] -> float32
        """Granite's logits_scaling, divided in the head's dtype before float32 as transformers."""
        scaling, cap = self.shape.logits_scaling, self.shape.final_logit_softcapping
        if cap is not None:  # Gemma 4's, in the head's dtype as transformers
            logits = torch.tanh(logits / cap) * cap
        return (logits if scaling == 1.0 else logits / scaling).float()

    def _spread(self, logits: torch.Tensor) -> torch.Tensor:  # [N, scored] -> [N, V], -inf filled
        out = logits.new_full((logits.shape[0], self.shape.vocab_size), -float("inf"))
        out[:, : self.head_rows] = logits[:, : self.head_rows]
        out[:, self.head_extra] = logits[:, self.head_rows :]
        return out

    def shard_sizes(self, module_name: str) -> list[int]:
        """Output rows of each shard of a linear layer (q/k/v and gate/up are fused)."""
        if module_name.endswith("qkv_proj"):  # its layer's sizes (Gemma 4's differ by kind)
            s = cast(Attention, self.get_submodule(module_name.rpartition(".")[0])).shape
            return [s.q_size, s.kv_size, s.kv_size]
        if module_name.endswith("gate_up_proj"):  # an expert's is narrower than the dense MLP's
            return [cast(int, self.get_submodule(module_name).out_features) // 2] * 2
        return [cast(int, self.get_submodule(module_name).out_features)]  # Linear or QuantLinear

    def load_weights(self, weights: Iterable[tuple[str, WeightValue]]) -> None:
        """Copy transformers-named tensors in, fusing q/k/v and gate/up; all must be covered.

        Modules that load their own weights (quantized layers: `load_shard`) get theirs as they
        come, quantized or float; plain parameters take quantized weights dequantized."""
        targets: dict[str, nn.Parameter | nn.Module] = dict(self.named_parameters())
        pending = {name: _num_shards(name) for name in targets}
        for module_name, module in self.named_modules():
            if hasattr(module, "load_shard"):
                targets[f"{module_name}.weight"] = module
                pending[f"{module_name}.weight"] = _num_shards(module_name)
        # a tied head limited to its first rows is a matrix of its own, copied from the table
        head_from_table = self.shape.tie_word_embeddings and "lm_head.weight" in targets
        for hf_name, tensor in weights:
            name = self._load_one(targets, hf_name, tensor)
            if name is not None:
                pending[name] -= 1
            if name == "embed_tokens.weight" and head_from_table:
                pending[self._load_one(targets, "lm_head.weight", tensor)] -= 1  # type: ignore[index]
        missing = sorted(name for name, left in pending.items() if left > 0)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")

    def _load_one(
        self, targets: dict[str, nn.Parameter | nn.Module], hf_name: str, tensor: WeightValue
    ) -> str | None:
        name = hf_name.removeprefix("model.")
        shard = 0
        for hf_part, (ours, fused_shard) in _FUSED.items():
            if f".{hf_part}." in name:
                name, shard = name.replace(hf_part, ours), fused_shard
                break
        if name not in targets:
            if name == "lm_head.weight" or "rotary_emb" in name:
                return None  # a tied head saved anyway; rotary buffers of old checkpoints
            raise ValueError(f"unexpected weight {hf_name!r} for this architecture")
        if name == "lm_head.weight" and self.head_rows < self.shape.vocab_size:
            extra = torch.tensor(self.head_extra, dtype=torch.long)
            tensor = _rows(tensor, torch.cat([torch.arange(self.head_rows), extra]))
        target = targets[name]
        if isinstance(target, nn.Parameter):
            dense = tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()
            self._copy_shard(target, name, dense, shard)
        else:
            target.load_shard(shard, tensor)  # type: ignore[operator]
        return name

    def _copy_shard(self, param: nn.Parameter, name: str, tensor: torch.Tensor, shard: int) -> None:
        if _num_shards(name) == 1:
            with torch.no_grad():
                param.copy_(tensor)
            return
        sizes = self.shard_sizes(name.rpartition(".")[0])
        start = sum(sizes[:shard])
        with torch.no_grad():
            param[start : start + sizes[shard]].copy_(tensor)


def _rows(value: WeightValue, ids: torch.Tensor) -> WeightValue:
    return value[ids] if isinstance(value, torch.Tensor) else value.rows(ids)


def _num_shards(name: str) -> int:
    return 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else 1
