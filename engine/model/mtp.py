"""Qwen3.5's multi-token-prediction (MTP) layer as a built-in draft head.

The checkpoint carries it beside the model (`mtp.*`, which transformers does not load): at
position i it reads the target's final hidden state h_i (after the final norm) and the next
token t_{i+1}, and predicts t_{i+2}:

    x = fc([pre_fc_norm_embedding(embed(t_{i+1})) ; pre_fc_norm_hidden(h_i)])
    y = norm(layer(x))          # one full-attention Qwen3.5 layer: gated, partial rotary
    logits = lm_head(y)         # the target's embedding and head, shared

A further draft feeds y back as h, one position further (vLLM's reading of the format). It has
the interface of an EAGLE-3 head (engine.model.eagle3), so the same proposer drives it: the
target keeps its final hidden states by position (`ModelRunner.keep_aux_hidden`), and the
head's K/V live in the target's KV slots (engine/model/head_kv.py), rolled back by position. The
layer is attention only, so no recurrent state needs rolling back on the draft's side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.decoder import RMSNorm, WeightValue
from engine.model.head_kv import HeadCache, HeadSpan
from engine.model.hybrid import HybridDecoderModel, partial_rope

PREFIX = "mtp."


class _MtpAttention(nn.Module):
    def __init__(self, model: HybridDecoderModel) -> None:
        super().__init__()
        s = model.shape
        self.q_proj = nn.Linear(s.hidden_size, 2 * s.q_size, bias=s.qkv_bias)  # query and gate
        self.k_proj = nn.Linear(s.hidden_size, s.kv_size, bias=s.qkv_bias)
        self.v_proj = nn.Linear(s.hidden_size, s.kv_size, bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.q_size, s.hidden_size, bias=s.o_bias)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, offset=True)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, offset=True)


class _MtpMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MtpLayer(nn.Module):
    def __init__(self, model: HybridDecoderModel) -> None:
        super().__init__()
        s = model.shape
        self.self_attn = _MtpAttention(model)
        self.mlp = _MtpMLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, offset=True)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, offset=True)


class MtpHead(nn.Module):
    def __init__(self, target: HybridDecoderModel) -> None:
        super().__init__()
        s = target.shape
        self.fc = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(s.hidden_size, s.rms_norm_eps, offset=True)
        self.pre_fc_norm_hidden = RMSNorm(s.hidden_size, s.rms_norm_eps, offset=True)
        self.layers = nn.ModuleList([_MtpLayer(target)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, offset=True)
        self.target = (target,)  # in a tuple: the target's module (embedding, head, rope)
        self.feature_width = s.hidden_size  # the target's final hidden state, as kept

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def _layer(self) -> _MtpLayer:
        return cast(_MtpLayer, self.layers[0])  # one, under the checkpoint's name layers.0

    def new_cache(self) -> HeadCache:
        s, weight = self.target[0].shape, self.fc.weight
        return HeadCache(s.num_kv_heads, s.head_dim, weight.dtype, weight.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [T, hidden]: read as they are
        return features.to(self.fc.weight.dtype)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the target's final hidden states, or the head's own
        token_ids: torch.Tensor,  # [T]: the token after each row's position
        spans: list[HeadSpan],  # the requests' rows, in order
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed (for logits), the same (the next hidden)
        layer = self._layer
        embeds = self.pre_fc_norm_embedding(self.target[0].embed_tokens(token_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = x + self._attend(layer.input_layernorm(x), spans)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = self.norm(x)
        return out, out

    def logits(self, normed: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] fp32
        return self.target[0].compute_logits(normed)

    def _attend(self, x: torch.Tensor, spans: list[HeadSpan]) -> torch.Tensor:  # [T, hidden]
        attn, s, num = self._layer.self_attn, self.target[0].shape, x.shape[0]
        rotary = self.target[0].rotary
        assert rotary is not None
        positions = torch.cat([torch.arange(sp.start, sp.start + sp.length) for sp in spans])
        rope = rotary.tables(positions.to(x.device), x.dtype)
        q, gate = attn.q_proj(x).view(num, s.num_heads, 2 * s.head_dim).chunk(2, dim=-1)
        rotary_dim = self.target[0].rotary_dim
        q = partial_rope(attn.q_norm(q), rope, rotary_dim)
        k = attn.k_norm(attn.k_proj(x).view(num, s.num_kv_heads, s.head_dim))
        k = partial_rope(k, rope, rotary_dim)
        v = attn.v_proj(x).view(num, s.num_kv_heads, s.head_dim)
        out, row = [], 0
        for span in spans:
            rows = slice(row, row + span.length)
            out.append(_attend_one(q[rows], k[rows], v[rows], span, s.head_dim**-0.5))
            row += span.length
        gated = torch.cat(out).reshape(num, s.q_size) * torch.sigmoid(gate.reshape(num, s.q_size))
        return attn.o_proj(gated)


def _attend_one(
    q: torch.Tensor,  # [L, heads, head_dim]
    k: torch.Tensor,  # [L, kv_heads, head_dim]
    v: torch.Tensor,  # [L, kv_heads, head_dim]
    span: HeadSpan,
    scale: float,
) -> torch.Tensor:  # [L, heads, head_dim]
    keys, values = span.cache.write(span.start, k, v)  # [start + L, kv_heads, head_dim]
    group = q.shape[1] // k.shape[1]
    keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, S, head_dim]
    values = values.transpose(0, 1).repeat_interleave(group, dim=0)
    query_pos = torch.arange(span.start, span.start + span.length, device=q.device)
    seen = torch.arange(keys.shape[1], device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=seen, scale=scale
    )
    return out.transpose(0, 1)


def load_mtp_head(
    target: HybridDecoderModel,
    weights: Iterable[tuple[str, WeightValue]],  # the checkpoint's, `mtp.*` among them
) -> MtpHead:
    """The head in the target's device and dtype; refused where the checkpoint has none."""
    weight = target.norm.weight
    with torch.device("meta"):
        head = MtpHead(target)
    head = head.to_empty(device=weight.device).to(weight.dtype)
    params = dict(head.named_parameters())
    missing = set(params)
    for name, value in weights:
        if not name.startswith(PREFIX):
            continue
        ours = name.removeprefix(PREFIX)
        if ours not in params:
            raise ValueError(f"unexpected MTP weight {name!r} (one dense MTP layer is served)")
        dense = value if isinstance(value, torch.Tensor) else value.dequantize()
        with torch.no_grad():
            params[ours].copy_(dense)
        missing.discard(ours)
    if missing == set(params):
        raise ValueError("the checkpoint has no MTP layers (mtp.*): --speculative-method mtp")
    if missing:
        raise ValueError(f"the checkpoint's MTP layer lacks {sorted(missing)[:6]}")
    return head.eval()
