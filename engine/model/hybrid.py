"""The hybrid Qwen3.5 (`Qwen3_5ForCausalLM`, `qwen3_5_text`): Gated DeltaNet linear-attention
layers (engine.model.linear_attention) beside full-attention layers, three to one by default.

Every norm scales by 1 + weight (the decoder's `norm_offset`); the full-attention layers are
Qwen3's with q/k norms, a partial rotary (the first quarter of each head, transformers' pairs i and
i + r/2) and an output gate: q_proj yields each head's query and a gate, and the attention output
is multiplied by sigmoid(gate) before o_proj. Only those layers have K/V in the paged pool; the
linear layers keep their state per request in the runner's `StatePool`. This runs the eager
torch path: the native DecoderStack and the compiled draft graph cover Llama's layer only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.model.attention import AttentionMetadata, paged_attention
from engine.model.decoder import (
    MLP,
    Attention,
    DecoderLayer,
    DecoderModel,
    KVCache,
    RMSNorm,
    WeightValue,
    gemm_input_dtype,
    gemm_unrounded,
)
from engine.model.linear_attention import GatedDeltaNet, LinearAttentionShape
from engine.model.rope import Rope, apply_rope, partial_rotary_factor
from engine.model.shape import DecoderShape
from engine.model.state_pool import StateBatch

LINEAR = "linear_attention"
_LAYER_TYPES = (LINEAR, "full_attention")


class GatedAttention(Attention):
    """Qwen3.5's full attention: Qwen3's, with partial rotary and a sigmoid gate on the output."""

    def __init__(self, shape: DecoderShape, rotary_dim: int) -> None:
        super().__init__(shape)
        self.rotary_dim = rotary_dim
        out = 2 * shape.q_size + 2 * shape.kv_size  # each head's query and gate, then k, v
        self.qkv_proj = nn.Linear(shape.hidden_size, out, bias=shape.qkv_bias)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        s = self.shape
        q_gate, k, v = self.qkv_proj(x).split([2 * s.q_size, s.kv_size, s.kv_size], dim=-1)
        q, gate = q_gate.view(-1, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
        assert self.q_norm is not None and self.k_norm is not None
        q = partial_rope(self.q_norm(q), rope, self.rotary_dim)
        k = partial_rope(self.k_norm(k.view(-1, s.num_kv_heads, s.head_dim)), rope, self.rotary_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        out = out * torch.sigmoid(gate.reshape(out.shape))
        return gemm_unrounded(self.o_proj, out)


def partial_rope(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    rope: Rope,  # the decoder's tables: pair j with j + head_dim / 2, the first r / 2 rotating
    rotary_dim: int,  # r
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """transformers' partial rotary: dims i and i + r/2 of the first r rotate, the rest pass.
    The decoder's tables hold the r/2 rotated frequencies first in each half."""
    r, half = rotary_dim, x.shape[-1] // 2
    cos, sin = rope
    cos_r = torch.cat([cos[..., : r // 2], cos[..., : r // 2]], dim=-1)
    sin_r = torch.cat([sin[..., : r // 2], sin[..., half : half + r // 2]], dim=-1)
    return torch.cat([apply_rope(x[..., :r], cos_r, sin_r), x[..., r:]], dim=-1)


class LinearAttentionLayer(nn.Module):
    """A decoder layer whose token mixer is a Gated DeltaNet."""

    def __init__(self, shape: DecoderShape, linear: LinearAttentionShape, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, shape.norm_offset)
        self.linear_attn = GatedDeltaNet(linear, index)
        self.post_attention_layernorm = RMSNorm(
            shape.hidden_size, shape.rms_norm_eps, shape.norm_offset
        )
        self.mlp = MLP(shape)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the last sublayer's output (or the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before x
        states: StateBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the MLP's output, the stream before it
        dtype = x.dtype if residual is None else residual.dtype
        h, residual = self.input_layernorm.add_forward(x, residual, dtype)
        x = self.linear_attn(h, states)
        h, residual = self.post_attention_layernorm.add_forward(
            x, residual, gemm_input_dtype(self.mlp.gate_up_proj, dtype)
        )
        return self.mlp(h, dtype), residual


class HybridDecoderModel(DecoderModel):
    """The decoder with some layers' attention replaced by Gated DeltaNet."""

    def __init__(self, shape: DecoderShape, linear: LinearAttentionShape, rotary_dim: int) -> None:
        super().__init__(shape)
        self.linear_shape = linear
        self.rotary_dim = rotary_dim
        self.linear_layers = tuple(i for i, t in enumerate(shape.layer_types) if t == LINEAR)
        self.layers = nn.ModuleList(self._layer(i, rotary_dim) for i in range(shape.num_layers))

    def _layer(self, i: int, rotary_dim: int) -> nn.Module:
        if i in self.linear_layers:
            return LinearAttentionLayer(self.shape, self.linear_shape, self.linear_layers.index(i))
        layer = DecoderLayer(self.shape, i)
        layer.self_attn = GatedAttention(self.shape, rotary_dim)
        return layer

    @property
    def num_kv_layers(self) -> int:
        return self.shape.num_layers - len(self.linear_layers)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # the full-attention layers' only
        meta: AttentionMetadata,
        states: StateBatch | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        assert self.rotary is not None, "call init_rotary first"
        if states is None:
            raise ValueError("a hybrid model's forward needs its requests' state slots")
        x = self.embed(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        residual: torch.Tensor | None = None
        kv = iter(kv_caches)
        for layer in self.layers:
            if isinstance(layer, LinearAttentionLayer):
                x, residual = layer(x, residual, states)
            else:
                x, residual = layer(x, residual, rope, next(kv), meta)
        dtype = x.dtype if residual is None else residual.dtype
        out = self.norm.add_forward(x, residual, dtype)[0]
        if self.aux_layers:  # an MTP head's input: the final hidden state, after the norm
            self.aux_hidden = out
        return out

    def shard_sizes(self, module_name: str) -> list[int]:
        if module_name.endswith("self_attn.qkv_proj"):  # each head's query and gate
            s = self.shape
            return [2 * s.q_size, s.kv_size, s.kv_size]
        return super().shard_sizes(module_name)

    def load_weights(self, weights: Iterable[tuple[str, WeightValue]]) -> None:
        """The text model's weights: a multimodal checkpoint's under `model.language_model.`
        (its vision tower's, `model.visual.`, skipped); the MTP layer's (`mtp.*`) are the MTP
        head's (engine.model.mtp)."""
        super().load_weights(
            (name.replace("model.language_model.", "model.", 1), value)
            for name, value in weights
            if not name.startswith(("mtp.", "model.visual."))
        )


def num_kv_layers(model: DecoderModel) -> int:
    """The layers with K/V in the paged pool: all but a hybrid model's linear ones."""
    if isinstance(model, HybridDecoderModel):
        return model.num_kv_layers
    return model.shape.num_layers


def build_qwen3_5(config: PretrainedConfig) -> HybridDecoderModel:
    """An uninitialized module (build it under a meta or target device context)."""
    types = tuple(config.layer_types)
    if set(types) - set(_LAYER_TYPES):
        raise ValueError(f"Qwen3.5 layer types {sorted(set(types) - set(_LAYER_TYPES))}")
    if config.hidden_act != "silu":
        raise ValueError(f"Qwen3.5 with hidden_act {config.hidden_act!r}: only silu")
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"Qwen3.5 with rope_type {params['rope_type']!r}: only default")
    bias = bool(getattr(config, "attention_bias", False))
    shape = DecoderShape.from_config(config, qkv_bias=bias, o_bias=bias, qk_norm=True)
    shape = replace(shape, norm_offset=True, layer_types=types)
    rotary_dim = int(shape.head_dim * partial_rotary_factor(config))
    return HybridDecoderModel(shape, LinearAttentionShape.from_config(config), rotary_dim)
