"""A mixture-of-experts MLP: a router sends each token to `top_k` of `num_experts` gated MLPs
and sums their outputs weighted by its probabilities (Qwen3-MoE).

The routing is transformers' own: router logits x W_r^T in the model dtype, a float32 softmax,
the top k, rescaled to sum to 1 where `norm_topk_prob` says, rounded to the model dtype. Each
expert is the decoder's own gated MLP (`expert()` builds one), so it is quantized, or run on a
GGUF file's blocks by the native kernels, exactly as a dense model's MLP is.

Rows are grouped by expert: one call per chosen expert with every row routed to it. A decode
step therefore reads only the chosen experts' weights, and a verify of k + 1 rows reads each
chosen expert's weights once, however many of its rows chose it.

Batch invariance (speculative greedy equals plain greedy): a row's output never depends on the
other rows. The GGUF kernels compute each row alone (engine.model.quant.native: an expert's
rows are never a whole forward's chunks, so they run native), the router computes each row
alone, and a row's expert outputs are
added in increasing expert id, the order transformers adds them in, whichever experts the rest
of the batch chose.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.quant import native_experts
from engine.model.shape import MoeShape


class Router(nn.Module):
    """Top-k routing over softmax probabilities. A plain parameter, not a linear layer: it stays
    in the model dtype under every quantization (llama.cpp keeps it in F32 too), since a router
    rounded to int4 would send tokens to other experts."""

    def __init__(self, hidden_size: int, moe: MoeShape) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.topk_then_softmax = moe.topk_then_softmax

    def forward(
        self, x: torch.Tensor, dtype: torch.dtype, native: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [T, hidden] -> weights [T, k] (dtype), ids [T, k]
        """`native`: the logits by the native experts' own kernel (x float32, no bias), which the
        native layer stack calls too: 16 float32 lanes a row where torch's bf16 GEMM takes ~90 us
        a call for a 128 x 2048 router."""
        if native:
            assert self.bias is None and x.dtype == torch.float32
            logits = native_experts.router_logits(x, self.weight)  # [T, num_experts] in dtype
        else:
            logits = _row_by_row(x.to(dtype), self.weight)  # [T, num_experts]
        if self.bias is not None:
            logits = logits + self.bias
        if self.topk_then_softmax:  # gpt-oss: the softmax over the chosen k, in the model dtype
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids


def _row_by_row(
    x: torch.Tensor,  # [T, hidden]
    weight: torch.Tensor,  # [num_experts, hidden]
) -> torch.Tensor:  # [T, num_experts]: x W^T, each row as F.linear computes it alone
    """A GEMM's result for a row depends on how many rows share the call (the BLAS blocks M): a
    router so computed could send a token elsewhere in a verify than in a decode. One call a row
    gives every row its one-row result whatever the batch; it costs ~40 us a row for a 128 x 2048
    router, little beside the experts it picks (a batched bmm of the same products copies the
    expanded weight: 9 ms a row in bfloat16)."""
    return torch.cat([F.linear(row, weight) for row in x.split(1)])


class MoE(nn.Module):
    """The routed MLP; `make_expert()` builds one expert (the decoder's gated MLP at the
    experts' size, `silu_experts` where its activation is SiLU)."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoeShape,
        make_expert: Callable[[], nn.Module],
        silu_experts: bool = False,  # each expert the decoder's gated SiLU MLP: native-ready
    ) -> None:
        super().__init__()
        self.silu_experts = silu_experts
        self.gate = Router(hidden_size, moe)  # transformers' and the checkpoints' name
        self.experts = nn.ModuleList(make_expert() for _ in range(moe.num_experts))

    @property
    def gate_up_proj(self) -> nn.Module:
        """An expert's first linear layer: the decoder asks it in which dtype to hand over x."""
        first = self.experts[0].gate_up_proj
        assert isinstance(first, nn.Module)
        return first

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the model dtype's values (float32 for GGUF experts)
        dtype: torch.dtype,  # the model's
    ) -> torch.Tensor:  # [T, hidden] in dtype
        native = self.native is not None and x.dtype == torch.float32
        native = (
            native and dtype in (torch.float32, torch.bfloat16) and self.gate.weight.dtype == dtype
        )
        weights, ids = self.gate(x, dtype, native)  # [T, k] each
        if native:
            assert self.native is not None
            return self.native.forward(x, ids, weights)  # the same sums, natively
        return self.grouped(x, dtype, weights, ids)

    def grouped(
        self,
        x: torch.Tensor,  # [T, hidden]
        dtype: torch.dtype,
        weights: torch.Tensor,  # [T, k] in dtype
        ids: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, hidden] in dtype
        """The chosen experts by the eager grouping: one call per expert with all its rows."""
        if x.shape[0] == 1:
            return self._one_row(x, dtype, weights[0], ids[0])
        out = torch.zeros(x.shape[0], x.shape[1], dtype=dtype, device=x.device)
        for expert, rows, slots in _rows_by_expert(ids, len(self.experts)):
            y = self.experts[expert](x[rows], dtype).to(dtype)  # [n, hidden]
            # weighted in the model dtype and added in expert order, as transformers does
            out.index_add_(0, rows, y * weights.view(-1)[slots, None])
        return out

    @cached_property
    def native(self) -> native_experts.NativeExperts | None:
        """The experts as one native call a step (quant.native_experts), once they are loaded:
        GGUF experts of one type on the native kernels. Else None: the grouping below."""
        return native_experts.build(self.experts) if self.silu_experts else None

    def _one_row(
        self,
        x: torch.Tensor,  # [1, hidden]
        dtype: torch.dtype,
        weights: torch.Tensor,  # [k] in dtype
        ids: torch.Tensor,  # [k]
    ) -> torch.Tensor:  # [1, hidden] in dtype
        """A lone row (a decode step): its k experts without the grouping's index ops, the same
        products added in the same order (increasing expert id) as `forward`'s."""
        out = torch.zeros(1, x.shape[1], dtype=dtype, device=x.device)
        for expert, slot in sorted((e, j) for j, e in enumerate(ids.tolist())):
            out += self.experts[expert](x, dtype).to(dtype) * weights[slot]
        return out


class ClampedSwiGLUExpert(nn.Module):
    """gpt-oss's expert: biased linear layers around a SwiGLU whose gate is clamped above at
    `limit` and whose up projection is clamped to [-limit, limit] and shifted by one:
    (up + 1) * gate * sigmoid(alpha * gate). Its checkpoint interleaves gate and up columns;
    the loader splits them (`split_gpt_oss_experts`)."""

    def __init__(self, hidden_size: int, expert_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.gate_up_proj: nn.Module = nn.Linear(hidden_size, 2 * expert_size)
        self.down_proj: nn.Module = nn.Linear(expert_size, hidden_size)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [n, H] -> [n, H]
        gate, up = self.gate_up_proj(x).to(dtype).chunk(2, dim=-1)  # [n, I] each
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        down: torch.Tensor = self.down_proj(act.to(getattr(self.down_proj, "input_dtype", dtype)))
        return down


def _rows_by_expert(
    ids: torch.Tensor,  # [T, k] the experts each row chose
    num_experts: int,
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:  # (expert, rows [n], slots [n]), by expert id
    """Each chosen expert with the rows routed to it (ascending) and their slots in ids.view(-1)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, rows ascending in each
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for expert, n in enumerate(counts):
        if n:
            slots = order[start : start + n]
            groups.append((expert, slots // k, slots))
            start += n
    return groups


def split_stacked_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers 5's stacked expert tensors (what its GGUF reader converts to) as the
    per-expert matrices the hub's checkpoints hold: `mlp.experts.gate_up_proj` [E, 2I, H] as
    `mlp.experts.E.gate_proj.weight` and `.up_proj.weight`, `mlp.experts.down_proj` [E, H, I]
    as `mlp.experts.E.down_proj.weight`; other weights pass through."""
    for name, value in weights:
        prefix, _, part = name.rpartition("mlp.experts.")
        if part not in ("gate_up_proj", "down_proj") or value.dim() != 3:
            yield name, value
            continue
        for e, matrix in enumerate(value):
            if part == "down_proj":
                yield f"{prefix}mlp.experts.{e}.down_proj.weight", matrix
            else:
                gate, up = matrix.chunk(2)
                yield f"{prefix}mlp.experts.{e}.gate_proj.weight", gate
                yield f"{prefix}mlp.experts.{e}.up_proj.weight", up


def split_gpt_oss_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's stacked experts as per-expert linear layers: `gate_up_proj` [E, H, 2I] (input
    rows, gate and up columns interleaved) and its bias [E, 2I], `down_proj` [E, I, H] and its
    bias [E, H]; the router `mlp.router` named as the MoE's `mlp.gate`."""
    for name, value in weights:
        prefix, _, part = name.rpartition("mlp.experts.")
        if part not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            name = name.replace(".mlp.router.", ".mlp.gate.")  # or already an expert's
            yield name.replace(".self_attn.sinks.weight", ".self_attn.sinks"), value  # GGUF's
            continue
        for e, matrix in enumerate(value):
            expert = f"{prefix}mlp.experts.{e}"
            kind = "bias" if part.endswith("_bias") else "weight"
            if part.startswith("down_proj"):
                yield f"{expert}.down_proj.{kind}", matrix if kind == "bias" else matrix.t()
                continue
            columns = matrix if kind == "bias" else matrix.t()  # [2I, ...]: gate, up, gate, ...
            yield f"{expert}.gate_proj.{kind}", columns[0::2]
            yield f"{expert}.up_proj.{kind}", columns[1::2]
