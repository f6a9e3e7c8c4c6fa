"""Gated DeltaNet: the linear-attention layers of the hybrid Qwen3.5 (beside full attention).

Each layer keeps, per request, a short causal-conv1d state (the last kernel - 1 inputs of its
q/k/v projection) and a recurrent state S [v_heads, k_dim, v_dim] that every token decays and
corrects by the delta rule:

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

A prompt chunk runs the chunked form (the same rule, 64 tokens at a time as a few matmuls); a
decode token, and each token of a verify's last token plus its drafts, the step form, which gives
the state after every one of them: the candidates a rejection rolls back to
(engine.model.state_pool). Both follow transformers' torch reference (`torch_chunk_gated_delta_rule`
and `torch_recurrent_gated_delta_rule` in models/qwen3_5) op for op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

if TYPE_CHECKING:
    from engine.model.state_pool import StateBatch

CHUNK = 64  # transformers' chunk size for the chunked form


@dataclass(frozen=True)
class LinearAttentionShape:
    """The sizes of a Gated DeltaNet layer, read once from a Qwen3.5 text config."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    # v heads in llama.cpp's tiled order (a GGUF's: engine.model.gguf_hybrid): v head p reads
    # k head p % k_heads; else grouped by k head, as transformers has them: p // (v / k)
    tiled_v_heads: bool = False

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> LinearAttentionShape:
        shape = cls(
            hidden_size=config.hidden_size,
            num_k_heads=config.linear_num_key_heads,
            num_v_heads=config.linear_num_value_heads,
            k_head_dim=config.linear_key_head_dim,
            v_head_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim,
            rms_norm_eps=config.rms_norm_eps,
            tiled_v_heads=bool(getattr(config, "linear_value_heads_tiled", False)),
        )
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        return shape

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:  # the last kernel - 1 inputs of the conv
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the core output, then times silu(z): transformers' Qwen3_5RMSNormGated."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(
        self,
        x: torch.Tensor,  # [rows, v_head_dim]
        gate: torch.Tensor,  # [rows, v_head_dim]
    ) -> torch.Tensor:  # [rows, v_head_dim], x's dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return (out * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer over a ragged batch; each request's conv and recurrent states
    are read from and written to the runner's pool through `StateBatch`."""

    def __init__(self, shape: LinearAttentionShape, index: int) -> None:
        super().__init__()
        self.shape = shape
        self.index = index  # this layer's place among the linear layers: its states in the pool
        s = shape
        self.in_proj_qkv = nn.Linear(s.hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.empty(s.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_v_heads))
        self.norm = GatedRMSNorm(s.v_head_dim, s.rms_norm_eps)
        self.out_proj = nn.Linear(s.value_dim, s.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        states: StateBatch,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        s = self.shape
        mixed = self.in_proj_qkv(x)  # [num_tokens, conv_dim]
        z = self.in_proj_z(x)  # [num_tokens, value_dim]
        beta = self.in_proj_b(x).sigmoid()  # [num_tokens, v_heads]
        # g = log of the decay, <= 0; in float32, as transformers (A would overflow in half)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        core = x.new_empty(x.shape[0], s.num_v_heads, s.v_head_dim)
        for seg in states.segments:
            rows = slice(seg.row, seg.row + seg.num_tokens)
            conv_state, recurrent = states.read(self.index, seg)
            kept = max(seg.num_candidates, 1)  # states kept: after each candidate, or the last
            qkv, conv_states = self._conv(mixed[rows], conv_state, kept)
            out, recurrent_states = self._delta_rule(
                qkv, g[rows], beta[rows], recurrent, seg.num_candidates
            )
            core[rows] = out.to(x.dtype)
            states.write(self.index, seg, conv_states, recurrent_states)
        normed = self.norm(core.view(-1, s.v_head_dim), z.view(-1, s.v_head_dim))
        return self.out_proj(normed.view(x.shape[0], s.value_dim))

    def _conv(
        self,
        x: torch.Tensor,  # [n, conv_dim]: one request's new projections
        state: torch.Tensor,  # [conv_dim, kernel - 1]: the inputs before them
        kept: int,  # states wanted: after each of the last `kept` tokens
    ) -> tuple[
        torch.Tensor, torch.Tensor
    ]:  # silu(conv) [n, conv_dim], states [kept, conv_dim, kernel - 1]
        weight = self.conv1d.weight  # [conv_dim, 1, kernel]
        width = weight.shape[-1] - 1
        full = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)
        out = F.conv1d(full[None], weight, groups=full.shape[0])[0]  # [conv_dim, n]
        n = x.shape[0]
        states = torch.stack([full[:, j + 1 : j + 1 + width] for j in range(n - kept, n)])
        return F.silu(out).t().to(x.dtype), states

    def _delta_rule(
        self,
        qkv: torch.Tensor,  # [n, conv_dim]: after the conv
        g: torch.Tensor,  # [n, v_heads] float32
        beta: torch.Tensor,  # [n, v_heads]
        state: torch.Tensor,  # [v_heads, k_dim, v_dim] float32
        num_candidates: int,  # > 0: step through the last ones, keeping the state after each
    ) -> tuple[
        torch.Tensor, torch.Tensor
    ]:  # out [n, v_heads, v_dim], states [kept, v_heads, k_dim, v_dim]
        """Chunked over a prompt chunk, stepped over a decode token or a verify's candidates, as
        transformers picks for prefill and decode."""
        s, n = self.shape, qkv.shape[0]
        q, k, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q, k = (l2norm(_expand_heads(t, s)) for t in (q, k))  # [v_heads, n, k_dim] float32
        v32 = v.reshape(n, s.num_v_heads, s.v_head_dim).transpose(0, 1).float()
        g32, beta32 = g.t().float(), beta.t().float()  # [v_heads, n]
        stepped = num_candidates or int(n == 1)
        split = n - stepped
        outs: list[torch.Tensor] = []
        if split > 0:
            head = slice(0, split)
            out, state = chunked_delta_rule(
                q[:, head], k[:, head], v32[:, head], g32[:, head], beta32[:, head], state
            )
            outs.append(out)
        states = state[None]
        if stepped > 0:
            tail = slice(split, n)
            out, states = stepped_delta_rule(
                q[:, tail], k[:, tail], v32[:, tail], g32[:, tail], beta32[:, tail], state
            )
            outs.append(out)
        return torch.cat(outs, dim=1).transpose(0, 1), states[-max(num_candidates, 1) :]


def _expand_heads(
    x: torch.Tensor,  # [n, key_dim]
    s: LinearAttentionShape,
) -> torch.Tensor:  # [v_heads, n, k_dim] float32: each k head serves v_heads / k_heads v heads
    heads = x.reshape(-1, s.num_k_heads, s.k_head_dim).float()
    ratio = s.num_v_heads // s.num_k_heads
    heads = heads.repeat(1, ratio, 1) if s.tiled_v_heads else heads.repeat_interleave(ratio, dim=1)
    return heads.transpose(0, 1).contiguous()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # [..., d]
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def stepped_delta_rule(
    q: torch.Tensor,  # [heads, n, k_dim] float32, normalized
    k: torch.Tensor,  # [heads, n, k_dim] float32, normalized
    v: torch.Tensor,  # [heads, n, v_dim] float32
    g: torch.Tensor,  # [heads, n]: log decay
    beta: torch.Tensor,  # [heads, n]
    state: torch.Tensor,  # [heads, k_dim, v_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [heads, n, v_dim], states [n, heads, k_dim, v_dim]
    """Token by token: the state after every token (a verify's candidates)."""
    q = q / q.shape[-1] ** 0.5
    outs, states = [], []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        memory = (state * k[:, t, :, None]).sum(dim=-2)  # [heads, v_dim]
        delta = (v[:, t] - memory) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        outs.append((state * q[:, t, :, None]).sum(dim=-2))
        states.append(state)
    return torch.stack(outs, dim=1), torch.stack(states)


def chunked_delta_rule(
    q: torch.Tensor,  # [heads, n, k_dim] float32, normalized
    k: torch.Tensor,  # [heads, n, k_dim] float32, normalized
    v: torch.Tensor,  # [heads, n, v_dim] float32
    g: torch.Tensor,  # [heads, n]: log decay
    beta: torch.Tensor,  # [heads, n]
    state: torch.Tensor,  # [heads, k_dim, v_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # out [heads, n, v_dim], final state
    """CHUNK tokens at a time: within a chunk the delta rule's sequential corrections are one
    unit-lower-triangular solve (the UT transform), between chunks the state carries over."""
    q = q * q.shape[-1] ** -0.5
    n = q.shape[1]
    pad = (CHUNK - n % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    heads, chunks = q.shape[0], q.shape[1] // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(heads, chunks, CHUNK, -1) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(heads, chunks, CHUNK).cumsum(dim=-1)  # log decay since the chunk's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * decay.exp()[..., None]
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, decayed_k_beta, upper=False, unitriangular=True
    )
    state = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    for i in range(chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, -1, out.shape[-1])[:, :n], state
