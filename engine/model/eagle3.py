"""An EAGLE-3 draft head in the public format (the one vLLM, SGLang / SpecForge and llama.cpp load).

A head is one Llama decoder layer that drafts from the target's own features. At position i it
reads the target's hidden states entering three of its layers (low, middle, high), fused by `fc`
([hidden, 3 * target_hidden]) into one vector h_i, and the embedding of the next token t_{i+1};
its attention takes [input_layernorm(embed) ; hidden_norm(h)] (width 2 * hidden), the residual
stream starts from h, and its output predicts t_{i+2} over a reduced draft vocabulary: draft id d
is target id d + d2t[d]. A further draft feeds the head's own output (before its final norm) back
as h. The embedding is the target's unless the file has its own.

The folder holds config.json (`architectures: ["LlamaForCausalLMEagle3"]`, the sizes,
`draft_vocab_size`, optional `target_hidden_size`, the target layers in
`eagle_aux_hidden_state_layer_ids` at the top or in `eagle_config`; vLLM's ids: j is the stream
entering layer j; num_layers, an extension, the last layer's output before the norm) and
safetensors files or a pytorch_model.bin: `fc.weight`, `midlayer.*` (or `layers.0.*`),
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optionally `embed_tokens.weight`.

The head's K/V is addressed by position (engine/model/head_kv.py): in the target's KV slots while
it serves, in a dense cache of its own for a tree's forks, a calibration or a test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from transformers import LlamaConfig

from engine.model.bundled import sha256_file
from engine.model.decoder import RMSNorm
from engine.model.head_kv import HeadCache, HeadSpan
from engine.model.quant.formats import quantize_int8
from engine.model.rope import Rotary, apply_rope

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    """The sizes a head needs, read once from its config.json."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target's (d2t maps into it)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: vLLM's default for the target's depth
    norm_before_residual: bool  # the residual starts from hidden_norm(h) rather than h
    qkv_bias: bool
    raw: dict[str, Any]  # the whole file, for the rope parameters

    @classmethod
    def read(cls, folder: Path) -> Eagle3Config:
        raw = json.loads((folder / "config.json").read_text())
        architectures = raw.get("architectures") or []
        if not any(a in ARCHITECTURES for a in architectures):
            raise ValueError(f"{folder} is not an EAGLE-3 head: architectures {architectures}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError("an EAGLE-3 head with more than one layer is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"EAGLE-3 head activation {raw['hidden_act']!r} is not supported")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError(
                "an EAGLE-3 head without the target's aux hidden states is not supported"
            )
        ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        return cls(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(j) for j in ids) if ids else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            qkv_bias=bool(raw.get("attention_bias", False)),
            raw=raw,
        )

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input stream `fc` fuses, in layer order."""
        ids = self.aux_layer_ids or (2, target_layers // 2, target_layers - 3)  # vLLM's default
        if len(set(ids)) != 3 or not all(0 <= j <= target_layers for j in ids):
            raise ValueError(
                f"EAGLE-3 needs three distinct target layers in [0, {target_layers}], got {ids}: "
                "set eagle_aux_hidden_state_layer_ids in the head's config.json"
            )
        return tuple(sorted(ids))

    def rope_config(self, max_positions: int) -> LlamaConfig:
        fields = {k: v for k, v in self.raw.items() if k not in ("architectures", "eagle_config")}
        return LlamaConfig(**{**fields, "max_position_embeddings": max_positions})


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        width = 2 * c.hidden_size  # [embedding ; hidden]
        self.q_proj = nn.Linear(width, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    def __init__(
        self,
        config: Eagle3Config,
        target_embed: nn.Module,  # the target's token embedding
        rotary: Rotary,
        own_embed: bool,  # the file has embed_tokens of its own
    ) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embed else None
        self.target_embed = (target_embed,)  # in a tuple: the target's module, not the head's
        self.rotary = rotary
        # draft id -> target id (d + d2t[d])
        self.register_buffer("target_ids", torch.arange(c.draft_vocab_size), persistent=False)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        table = self.embed_tokens if self.embed_tokens is not None else self.target_embed[0]
        return table(token_ids).to(self.norm.weight.dtype)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def feature_width(self) -> int:  # the target's three kept streams
        return 3 * self.config.target_hidden_size

    def new_cache(self) -> HeadCache:
        c, weight = self.config, self.norm.weight
        return HeadCache(c.num_kv_heads, c.head_dim, weight.dtype, weight.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:  # [T, 3 * target_hidden] -> [T, hidden]
        return self.fc(aux.to(self.norm.weight.dtype))

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]: fused target features, or the head's own prenorm
        token_ids: torch.Tensor,  # [T]: the token after each row's position
        spans: list[HeadSpan],  # the requests' rows, in order
    ) -> tuple[torch.Tensor, torch.Tensor]:  # normed (for logits), prenorm (the next hidden)
        """Every request's rows in one pass: the projections batched, attention per request."""
        layer, c = self.midlayer, self.config
        embeds = self.embed(token_ids)
        h = layer.hidden_norm(hidden)
        residual = h if c.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), h], dim=-1)  # [T, 2 * hidden]
        residual = residual + self._attend(x, spans)
        residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        return self.norm(residual), residual

    def _attend(self, x: torch.Tensor, spans: list[HeadSpan]) -> torch.Tensor:  # [T, hidden]
        attn, c, num = self.midlayer.self_attn, self.config, x.shape[0]
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in spans])
        cos, sin = self.rotary.tables(positions.to(x.device), x.dtype)
        q = apply_rope(attn.q_proj(x).view(num, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(attn.k_proj(x).view(num, c.num_kv_heads, c.head_dim), cos, sin)
        v = attn.v_proj(x).view(num, c.num_kv_heads, c.head_dim)
        out, row = [], 0
        for span in spans:
            rows = slice(row, row + span.length)
            out.append(self._attend_one(q[rows], k[rows], v[rows], span))
            row += span.length
        return attn.o_proj(torch.cat(out).reshape(num, c.num_heads * c.head_dim))

    def _attend_one(
        self,
        q: torch.Tensor,  # [L, heads, head_dim]
        k: torch.Tensor,  # [L, kv_heads, head_dim]
        v: torch.Tensor,  # [L, kv_heads, head_dim]
        span: HeadSpan,
    ) -> torch.Tensor:  # [L, heads, head_dim]
        keys, values = span.cache.write(span.start, k, v)  # [start + L, kv_heads, head_dim]
        group = self.config.num_heads // self.config.num_kv_heads
        keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [heads, S, head_dim]
        values = values.transpose(0, 1).repeat_interleave(group, dim=0)
        # row i sits at position start + i and sees keys [0, start + i]
        query_pos = torch.arange(span.start, span.start + span.length, device=q.device)
        seen = torch.arange(keys.shape[1], device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=seen)
        return out.transpose(0, 1)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        """Over the target's vocabulary: -inf wherever the draft vocabulary has no id, so the
        draft's q is zero there and rejection sampling stays exact."""
        scored = self.lm_head(normed).float()  # [N, draft_vocab]
        out = scored.new_full((scored.shape[0], self.config.vocab_size), -float("inf"))
        out[:, self.target_ids] = scored
        return out


def load_eagle3_head(
    path: str,
    target_embed: nn.Module,  # the target's token embedding, used unless the file has its own
    target_hidden_size: int,
    target_vocab_size: int,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    native: bool = False,  # its linear layers as Q8_0 blocks on the native kernels (CPU)
) -> Eagle3Head:
    folder = Path(path)
    config = Eagle3Config.read(folder)
    if config.target_hidden_size != target_hidden_size:
        raise ValueError(
            f"EAGLE-3 head expects target hidden size {config.target_hidden_size}, "
            f"the target has {target_hidden_size}"
        )
    if config.vocab_size > target_vocab_size:
        raise ValueError(f"EAGLE-3 head vocab {config.vocab_size} > target's {target_vocab_size}")
    weights = _read_weights(folder)
    d2t, t2d = weights.pop("d2t", None), weights.pop("t2d", None)
    own_embed = "embed_tokens.weight" in weights
    if not own_embed and config.hidden_size != target_hidden_size:
        raise ValueError("an EAGLE-3 head narrower than its target needs its own embed_tokens")
    rotary = Rotary(config.rope_config(max_positions), config.head_dim, device)
    with torch.device("meta"):
        head = Eagle3Head(config, target_embed, rotary, own_embed)
    head = head.to_empty(device=device).to(dtype)
    try:
        head.load_state_dict(weights)  # strict: every name of the format, no others
    except RuntimeError as e:
        raise ValueError(f"{folder}: not the EAGLE-3 head's weights: {e}") from None
    head.target_ids = _target_ids(config, d2t, t2d).to(device)
    if native:
        to_native(head, dtype)
    return head.requires_grad_(False).eval()


class NativeLinear(nn.Module):
    """A head's linear layer on the native GGUF kernel, its weight rounded to Q8_0 blocks: half
    the bytes of bfloat16 a step reads (the drafts are verified, so their rounding costs
    acceptance at most, never correctness)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        import gguf

        from engine.model.quant.formats import GgufBlocks
        from engine.model.quant.native import GgufKernel

        q8_0 = gguf.GGMLQuantizationType.Q8_0
        rows = gguf.quants.quantize(linear.weight.detach().float().cpu().numpy(), q8_0)
        weight = GgufBlocks(torch.from_numpy(rows), int(q8_0), linear.in_features, "Q8_0")
        self.kernel = GgufKernel(weight, dtype)
        self.bias = linear.bias
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        y = self.kernel.native(x.reshape(-1, x.shape[-1])).to(self.dtype)
        y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])


def to_native(head: nn.Module, dtype: torch.dtype) -> None:
    """Every nn.Linear of the head (fc, the layer's projections, lm_head) as a NativeLinear."""
    for name, module in list(head.named_modules()):
        if isinstance(module, nn.Linear) and module.in_features % 32 == 0:
            parent, _, attr = name.rpartition(".")
            setattr(
                head.get_submodule(parent) if parent else head, attr, NativeLinear(module, dtype)
            )


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """safetensors files, else a pytorch_model.bin (the EAGLE authors' own heads ship one), read
    as tensors only (`weights_only`: no code in the file runs); files listed in a SHA256SUMS
    beside them checked first, int8 matrices with a `weight_scale` dequantized."""
    check_sha256sums(folder)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        raw = {name: t for file in files for name, t in load_file(str(file)).items()}
    elif (folder / "pytorch_model.bin").is_file():
        raw = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{folder} has no .safetensors or pytorch_model.bin (the head's weights)")
    return {
        name.removeprefix("model.").replace("layers.0.", "midlayer."): t
        for name, t in dequantized(raw).items()
    }


def dequantized(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 matrices stored with a per-row scale (`X.weight` int8 [out, in] and
    `X.weight_scale` [out, 1], compressed-tensors' names) as float32: q * scale."""
    out = {}
    for name, t in weights.items():
        if name.endswith(".weight_scale"):
            continue
        scale = weights.get(name + "_scale")
        if t.dtype == torch.int8 and scale is not None:
            t = t.float() * scale.float().reshape(-1, 1)
        out[name] = t
    return out


def quantized_int8(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`dequantized`'s inverse for the 2-D float matrices: symmetric int8 per output row."""
    out = {}
    for name, t in weights.items():
        if t.dim() == 2 and t.is_floating_point() and name.endswith(".weight"):
            rows = quantize_int8(t, scale_dtype=torch.float32)
            out[name], out[name + "_scale"] = rows.q, rows.scale[:, None]
        else:
            out[name] = t
    return out


def check_sha256sums(folder: Path) -> None:
    """Every file a SHA256SUMS in the folder lists (`<hex>  <name>` lines) must hash to it."""
    sums = folder / "SHA256SUMS"
    if not sums.is_file():
        return
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        want, name = line.split(maxsplit=1)
        digest = sha256_file(folder / name.lstrip("*"))
        if digest != want:
            raise ValueError(f"{folder / name}: sha256 {digest}, SHA256SUMS says {want}")


def _target_ids(
    config: Eagle3Config, d2t: torch.Tensor | None, t2d: torch.Tensor | None
) -> torch.Tensor:  # [draft_vocab] long
    """Each draft id's target id, checked: in range, distinct, and where t2d marks them."""
    base = torch.arange(config.draft_vocab_size)
    if d2t is None:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError("an EAGLE-3 head with a reduced vocabulary needs d2t")
        return base
    ids = base + d2t.long()
    if ids.min() < 0 or ids.max() >= config.vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError("EAGLE-3 head d2t maps draft ids outside the vocabulary or twice")
    if t2d is not None and not torch.equal(t2d.bool().nonzero().flatten(), ids.sort().values):
        raise ValueError("EAGLE-3 head t2d and d2t disagree")
    return ids
