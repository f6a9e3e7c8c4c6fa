"""Megatron-style sharding of a loaded DecoderModel by module swap.

Column-parallel: q, k, v and gate, up keep only this rank's heads / intermediate rows (each is
sharded on its own, then fused again), so attention and SiLU run on local shards with no
communication. Row-parallel: o_proj and down_proj keep the matching input columns; each
rank's partial product is summed by one all-reduce, and the bias is added once, after it.
KV heads split with the query heads; past the KV head count they are replicated (rank r keeps
head r // (tp / num_kv_heads)). Embedding, norms and lm_head stay whole (replicated).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.decoder import MLP, Attention, DecoderLayer, DecoderModel
from engine.model.shape import DecoderShape
from engine.model.tensor_parallel import TensorParallel


class RowParallelLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in / tp]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in / tp] -> [.., out]
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def check_shardable(shape: DecoderShape, world_size: int) -> None:
    kv, tp = shape.num_kv_heads, world_size
    if shape.moe is not None:
        raise ValueError("tensor parallelism does not shard routed experts (mixture of experts)")
    if shape.global_head_dim is not None:
        raise ValueError("tensor parallelism does not shard layers of two head sizes (Gemma 4)")
    if shape.qk_norm_flat:  # its mean spans every head: one rank's heads would not do
        raise ValueError("tensor parallelism does not shard q/k norms over all heads (OLMo 2)")
    if shape.num_heads % tp or shape.intermediate_size % tp or (kv % tp and tp % kv):
        raise ValueError(
            f"tensor_parallel_size {tp} must divide the attention heads ({shape.num_heads}) and "
            f"the MLP width ({shape.intermediate_size}), and divide or be a multiple of the "
            f"KV heads ({kv})"
        )


def local_shape(shape: DecoderShape, world_size: int) -> DecoderShape:
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // world_size,
        num_kv_heads=max(1, shape.num_kv_heads // world_size),
        intermediate_size=shape.intermediate_size // world_size,
    )


def shard_decoder(model: DecoderModel, tp: TensorParallel) -> None:
    """Swap every layer's projections for this rank's shards (after load_weights)."""
    check_shardable(model.shape, tp.world_size)
    local = local_shape(model.shape, tp.world_size)
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        _shard_attention(layer.self_attn, local, tp)
        assert isinstance(layer.mlp, MLP)  # check_shardable refused routed experts
        _shard_mlp(layer.mlp, local, tp)
    model.shape = local


def _shard_attention(attn: Attention, local: DecoderShape, tp: TensorParallel) -> None:
    full, d = attn.shape, attn.shape.head_dim
    q_start = tp.rank * local.q_size
    kv_start = (tp.rank * full.num_kv_heads // tp.world_size) * d  # replicated past kv heads
    sizes = [full.q_size, full.kv_size, full.kv_size]
    starts = [q_start, kv_start, kv_start]
    local_sizes = [local.q_size, local.kv_size, local.kv_size]

    def shard(
        fused: torch.Tensor,
    ) -> torch.Tensor:  # [q + 2 kv, ...] -> [local q + 2 local kv, ...]
        parts = fused.split(sizes)
        return torch.cat(
            [_slice(x, a, n) for x, a, n in zip(parts, starts, local_sizes, strict=True)]
        )

    qkv = _require_linear(attn.qkv_proj)
    attn.qkv_proj = _linear(shard(qkv.weight), None if qkv.bias is None else shard(qkv.bias))
    o_proj = _require_linear(attn.o_proj)
    o_weight = o_proj.weight[:, q_start : q_start + local.q_size]
    attn.o_proj = RowParallelLinear(o_weight.contiguous(), o_proj.bias, tp)
    attn.shape = local


def _shard_mlp(mlp: MLP, local: DecoderShape, tp: TensorParallel) -> None:
    width = local.intermediate_size
    start = tp.rank * width
    gate, up = _require_linear(mlp.gate_up_proj).weight.chunk(2)
    mlp.gate_up_proj = _linear(torch.cat([_slice(gate, start, width), _slice(up, start, width)]))
    down = _require_linear(mlp.down_proj)
    columns = down.weight[:, start : start + width]
    mlp.down_proj = RowParallelLinear(columns.contiguous(), down.bias, tp)
    mlp.intermediate_size = width


def _slice(x: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return x[start : start + size]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    out_features, in_features = weight.shape
    with torch.device("meta"):
        layer = nn.Linear(in_features, out_features, bias=bias is not None)
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


def _require_linear(module: nn.Module) -> nn.Linear:
    if type(module) is not nn.Linear:
        raise ValueError(
            f"tensor parallelism shards plain nn.Linear layers, not {type(module).__name__}: "
            "use quantization none with tensor_parallel_size > 1"
        )
    return module
