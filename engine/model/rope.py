"""Rotary position embeddings: cos/sin tables per position, and their application.

A model's rope comes from its transformers config: `rope_parameters` (rope_theta, and a scaling
type whose inverse frequencies transformers' own init functions compute). Models whose layer
types rotate differently (Gemma 3: local layers at `rope_local_base_freq`, global layers at
`rope_theta` with their scaling) nest one such dict per layer type; `layer_type` picks one.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: [num_tokens, 1, head_dim] each


class Rotary:
    """Precomputed cos/sin tables (float32) for positions [0, max_positions)."""

    def __init__(
        self,
        config: PretrainedConfig,
        head_dim: int,
        device: torch.device,
        layer_type: str | None = None,  # a key of a per-layer-type rope_parameters
    ) -> None:
        inv_freq, scaling = _inv_freq(config, head_dim, layer_type)  # [rotated pairs]
        positions = torch.arange(_rope_table_len(config), dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotated pairs]
        # pairs past the rotated ones pass unchanged, unscaled (partial rotary: the dims a
        # checkpoint passes are moved onto them at load, engine.model.families)
        passed = (len(positions), head_dim // 2 - inv_freq.numel())
        cos = torch.cat((freqs.cos() * scaling, freqs.new_ones(passed)), dim=-1)
        sin = torch.cat((freqs.sin() * scaling, freqs.new_zeros(passed)), dim=-1)
        self.cos = torch.cat((cos, cos), dim=-1).to(device)  # [max_positions, head_dim]
        # sin with its first half negated: rotate_half(x) * sin == x.roll(half) * signed_sin
        self.signed_sin = torch.cat((-sin, sin), dim=-1).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        cos, sin = self.cos[positions].to(dtype), self.signed_sin[positions].to(dtype)
        return cos[:, None], sin[:, None]


def rope_layer_types(config: PretrainedConfig) -> tuple[str, ...]:
    """The layer types with rope parameters of their own (Gemma 3's); () for one rope."""
    params = getattr(config, "rope_parameters", None) or {}
    return tuple(sorted(k for k, v in params.items() if isinstance(v, dict)))


def partial_rotary_factor(config: PretrainedConfig) -> float:
    """The share of each head's dims that rotate (Phi-4-mini: 0.75; most models: all)."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    return float(factor or 1.0)


def rope_positions_limit(config: PretrainedConfig) -> int | None:
    """The sequence length up to which transformers rotates as our one table does (None: any).
    Its longrope (Phi-3) moves a sequence to the long factors once it passes
    original_max_position_embeddings, every position at once: keys cached with the short ones
    could not follow, so such a model is served within that length (the short factors, exact)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    original = params.get("original_max_position_embeddings")
    return int(original or config.original_max_position_embeddings)


def _inv_freq(
    config: PretrainedConfig, head_dim: int, layer_type: str | None
) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
        return inv_freq.float(), float(scaling)
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = int(head_dim * partial_rotary_factor(config))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponents), 1.0


def _rope_table_len(config: PretrainedConfig) -> int:
    return int(config.max_position_embeddings)


def apply_rope(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]: sin, its first half negated
) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) taken as a roll of x
    times the sign folded into the table: the same products, four ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
