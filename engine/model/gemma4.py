"""What Gemma 4's small models (E2B, E4B) add to its decoder: per-layer embeddings and KV sharing.

Per-layer embeddings (PLE, `hidden_size_per_layer_input` P > 0): a second table gives each token
P values per layer, added (times 1/sqrt 2) to a normed projection of its embedding; after each
layer's MLP, the stream goes through a gate (hidden -> P), GeGLU's activation times the layer's
P values, a projection back and a norm, and joins the stream before the layer scalar.

KV sharing (`num_kv_shared_layers` n): the last n layers compute no K/V; each attends to the K/V
the last earlier layer of its type wrote in this same forward (`kv_sources`), so its attention
is a query projection, its norm and rope, and the paged attention over that layer's pool.
`use_double_wide_mlp` doubles those layers' MLP width. The runner still allocates a pool for
every layer: a shared layer's stays unused (memory, not correctness).

Everything else is the decoder's (engine.model.family_switches.gemma4_shape).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.model.attention import AttentionMetadata, attend
from engine.model.decoder import MLP, DecoderLayer, DecoderModel, KVCache, gemm_unrounded
from engine.model.norms import RMSNorm
from engine.model.rope import Rope, apply_rope
from engine.model.shape import DecoderShape


@dataclass(frozen=True)
class Gemma4Extras:
    per_layer_size: int  # P: per-layer embedding values a layer (0: none)
    per_layer_vocab: int  # rows of the per-layer table
    kv_sources: tuple[int, ...]  # per layer, the layer whose K/V it attends (itself unless shared)
    double_wide: bool  # shared layers' MLP twice as wide

    def shared(self, layer: int) -> bool:
        return self.kv_sources[layer] != layer


def gemma4_extras(config: PretrainedConfig) -> Gemma4Extras:
    types, shared = list(config.layer_types), int(config.num_kv_shared_layers or 0)
    first_shared = len(types) - shared
    sources = list(range(first_shared))
    for i in range(first_shared, len(types)):
        sources.append(max(j for j in range(first_shared) if types[j] == types[i]))
    return Gemma4Extras(
        per_layer_size=int(config.hidden_size_per_layer_input or 0),
        per_layer_vocab=int(config.vocab_size_per_layer_input or 0),
        kv_sources=tuple(sources),
        double_wide=bool(getattr(config, "use_double_wide_mlp", False)) and shared > 0,
    )


def build_gemma4(shape: DecoderShape, extras: Gemma4Extras) -> DecoderModel:
    plain = not extras.per_layer_size and not any(map(extras.shared, range(shape.num_layers)))
    return DecoderModel(shape) if plain else Gemma4Model(shape, extras)


class SharedKVAttention(nn.Module):
    """A KV-shared layer's attention: its query over the K/V another layer wrote."""

    def __init__(self, shape: DecoderShape, sliding: bool) -> None:
        super().__init__()
        self.shape, self.sliding = shape, sliding
        self.query = nn.Linear(shape.hidden_size, shape.q_size, bias=shape.qkv_bias)
        self.o_proj: nn.Module = nn.Linear(shape.q_size, shape.hidden_size, bias=shape.o_bias)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps, late_round=True)
        self.scale = shape.attention_scale

    @property
    def qkv_proj(self) -> nn.Module:  # what DecoderLayer asks of an attention's first GEMM
        return self.query

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: Rope,
        kv_cache: KVCache,  # the source layer's, this forward's K/V already written
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        s = self.shape
        if self.sliding:
            assert meta.sliding is not None
            meta = meta.sliding
        q = self.q_norm(self.query(x).view(-1, s.num_heads, s.head_dim))
        out = attend(apply_rope(q, *rope), kv_cache[0], kv_cache[1], meta, self.scale)
        return gemm_unrounded(self.o_proj, out)


class Gemma4Layer(DecoderLayer):
    """The decoder's layer with Gemma 4's per-layer input after the MLP, before the scalar."""

    def __init__(self, shape: DecoderShape, index: int, extras: Gemma4Extras) -> None:
        super().__init__(shape, index)
        if extras.shared(index):
            self.self_attn = SharedKVAttention(shape.attention_shape(index), self.sliding)  # type: ignore[assignment]
            if extras.double_wide:
                self.mlp = MLP(replace(shape, intermediate_size=2 * shape.intermediate_size))
        size, p = shape.hidden_size, extras.per_layer_size
        self.per_layer_input_gate = nn.Linear(size, p, bias=False) if p else None
        self.per_layer_projection = nn.Linear(p, size, bias=False) if p else None
        self.post_per_layer_input_norm = (
            RMSNorm(size, shape.rms_norm_eps, late_round=True) if p else None
        )
        self._per_layer_input: torch.Tensor | None = None  # this forward's [T, P]

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        per_layer_input: torch.Tensor | None = None,  # [num_tokens, P]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._per_layer_input = per_layer_input
        try:
            return super().forward(x, residual, rope, kv_cache, meta)
        finally:
            self._per_layer_input = None

    def _scaled_stream(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        total = x.to(residual.dtype) + residual  # [num_tokens, hidden]
        if self._per_layer_input is not None:
            assert self.per_layer_input_gate is not None and self.per_layer_projection is not None
            assert self.post_per_layer_input_norm is not None
            h = F.gelu(self.per_layer_input_gate(total), approximate="tanh") * self._per_layer_input
            total = total + self.post_per_layer_input_norm(self.per_layer_projection(h))
        assert self.layer_scalar is not None
        return total * self.layer_scalar.to(total.dtype), None


class Gemma4Model(DecoderModel):
    """Gemma 4 with per-layer embeddings or KV-shared layers (E2B, E4B)."""

    def __init__(self, shape: DecoderShape, extras: Gemma4Extras) -> None:
        super().__init__(shape)
        self.extras = extras
        self.layers = nn.ModuleList(Gemma4Layer(shape, i, extras) for i in range(shape.num_layers))
        p, layers = extras.per_layer_size, shape.num_layers
        if p:
            self.embed_tokens_per_layer = nn.Embedding(extras.per_layer_vocab, layers * p)
            self.per_layer_model_projection = nn.Linear(shape.hidden_size, layers * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, shape.rms_norm_eps, late_round=True)

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
        local = (self.local_rotary or self.rotary).tables(positions, x.dtype)
        per_layer = self._per_layer_inputs(input_ids, x)  # [T, layers, P] or None
        residual: torch.Tensor | None = None
        aux: list[torch.Tensor] = []  # the kept streams (DecoderModel.aux_layers)
        for i, layer in enumerate(self.layers):
            if i in self.aux_layers:
                aux.append(x if residual is None else x.to(residual.dtype) + residual)
            kv = kv_caches[self.extras.kv_sources[i]]
            pli = None if per_layer is None else per_layer[:, i]
            x, residual = layer(x, residual, local if layer.sliding else rope, kv, meta, pli)
        return self.final_norm(x, residual, aux)

    def _per_layer_inputs(
        self,
        input_ids: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]: the scaled embeddings
    ) -> torch.Tensor | None:  # [T, layers, P]
        """The table's values (times sqrt P in its dtype) and the embeddings' normed projection
        (times hidden^-1/2), summed times 2^-1/2, as transformers' Gemma4TextModel."""
        p = self.extras.per_layer_size
        if not p:
            return None
        table = self.embed_tokens_per_layer(input_ids)
        table = (table * torch.tensor(p**0.5).to(table.dtype)).view(len(input_ids), -1, p)
        proj = self.per_layer_model_projection(x) * self.shape.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(len(input_ids), -1, p))
        return (proj + table) * 2.0**-0.5
