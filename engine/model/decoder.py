"""The decoder-only family: Llama 2/3, Qwen2/2.5, Qwen3, Mistral, SmolLM.

One module covers them all: RMSNorm, RoPE (scaling from transformers' own init functions),
grouped-query attention with optional QKV bias (Qwen2) and q/k RMSNorm (Qwen3), a SwiGLU MLP,
tied or untied embeddings. It runs over a flat ragged batch (`input_ids [T]`, `positions [T]`)
with paged KV caches described by one `AttentionMetadata`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Union, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.kernels import fused_ops
from engine.model.attention import AttentionMetadata, attend, paged_attention
from engine.model.quant.formats import QuantizedWeight

if TYPE_CHECKING:
    from engine.model.quant.gguf_weights import GgufRows

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V: [kv_heads, num_blocks, block_size, dim]
# a checkpoint tensor, or a GGUF's quantized one (engine.model.quant): kept quantized, or left in the file
WeightValue = Union[torch.Tensor, QuantizedWeight, "GgufRows"]


@dataclass(frozen=True)
class DecoderShape:
    """The sizes the module needs, read once from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> DecoderShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in float32 and round before the weight, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: a sublayer's output (float32 before rounding)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before it (None: none)
        out_dtype: torch.dtype,  # the model's, or float32 for a GEMM that reads float32
    ) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual) in out_dtype, x + residual
        """The residual add and the norm after it, one native pass where the fused ops run (the
        same roundings as the eager ops); compiled graphs keep the eager ops for inductor to fuse."""
        if not torch.compiler.is_compiling() and fused_ops.usable(x):
            if residual is None:
                return fused_ops.rmsnorm(x, self.weight, self.eps, out_dtype), x
            return fused_ops.add_rmsnorm(x, residual, self.weight, self.eps, out_dtype)
        total = x if residual is None else x.to(residual.dtype) + residual
        return self(total).to(out_dtype), total


def silu_mul(
    gate_up: torch.Tensor,  # [num_tokens, 2 * intermediate]: dtype, or float32 before rounding
    dtype: torch.dtype,  # the model's: where the eager ops round
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [num_tokens, intermediate]: silu(gate) * up
    if not torch.compiler.is_compiling() and fused_ops.usable(gate_up):
        if dtype in (torch.float32, torch.bfloat16):
            return fused_ops.silu_mul(gate_up, dtype, out_dtype)
    return fused_ops.silu_mul_reference(gate_up, dtype, out_dtype)


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


class Rotary:
    """Precomputed cos/sin tables (float32) for positions [0, max_positions)."""

    def __init__(self, config: PretrainedConfig, head_dim: int, device: torch.device) -> None:
        inv_freq, scaling = _inv_freq(config, head_dim)
        positions = torch.arange(_rope_table_len(config), dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        signs = torch.cat((-torch.ones_like(freqs), torch.ones_like(freqs)), dim=-1)
        self.cos = (emb.cos() * scaling).to(device)  # [max_positions, head_dim]
        # sin with its first half negated: rotate_half(x) * sin == x.roll(half) * signed_sin
        self.signed_sin = (emb.sin() * scaling * signs).to(device)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_tokens, 1, head_dim]: cos, signed sin
        cos, sin = self.cos[positions].to(dtype), self.signed_sin[positions].to(dtype)
        return cos[:, None], sin[:, None]


def _inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
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


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        out = shape.q_size + 2 * shape.kv_size
        self.qkv_proj = nn.Linear(shape.hidden_size, out, bias=shape.qkv_bias)
        # nn.Module: quantization and tensor parallelism swap the row-parallel projections
        self.o_proj: nn.Module = nn.Linear(shape.q_size, shape.hidden_size, bias=shape.o_bias)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = shape.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]: the model dtype, or float32 before rounding to it
        s = self.shape
        qk, v = self.qkv_proj(x).split([s.q_size + s.kv_size, s.kv_size], dim=-1)
        qk = qk.view(-1, s.num_heads + s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if fused_ops.rope_kv_usable(qk, kv_cache[0]):  # rotate and write K/V in one pass
            q = fused_ops.rope_write_kv(qk, v, *rope, *kv_cache, meta.slot_mapping, s.num_heads)
            out = attend(q, kv_cache[0], kv_cache[1], meta, self.scale)
        else:
            q, k = apply_rope(qk, *rope).split([s.num_heads, s.num_kv_heads], dim=1)
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return gemm_unrounded(self.o_proj, out)  # the next norm rounds it


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.intermediate_size = shape.intermediate_size
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
        act = silu_mul(gate_up, dtype, gemm_input_dtype(self.down_proj, dtype))
        return gemm_unrounded(self.down_proj, act)  # the next norm rounds it


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the last sublayer's output (or the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the stream before x; None: none
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the MLP's output, the stream before it
        """The residual add is left to the next norm (`RMSNorm.add_forward`), which fuses it; so
        is rounding a GEMM's float32 output to the model dtype."""
        attn, mlp = self.self_attn, self.mlp
        dtype = x.dtype if residual is None else residual.dtype  # the model's
        h, residual = self.input_layernorm.add_forward(
            x, residual, gemm_input_dtype(attn.qkv_proj, dtype)
        )
        x = attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(
            x, residual, gemm_input_dtype(mlp.gate_up_proj, dtype)
        )
        return mlp(h, dtype), residual


# transformers parameter name suffix -> (our parameter, shard index within a fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LayerStack(Protocol):
    """run_layers done elsewhere for the forwards it accepts (engine.model.decoder_stack)."""

    def accepts(self, x: torch.Tensor, meta: AttentionMetadata) -> bool: ...

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embedded tokens
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...  # [num_tokens, hidden]: the final norm's output


class DecoderModel(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = (
            None
            if shape.tie_word_embeddings
            else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        )
        self.rotary: Rotary | None = None
        # the layer stack as a compiled graph where it fits the batch (engine.model.decode_graph)
        self.compiled_layers: Callable[..., torch.Tensor] | None = None
        # the layer stack in one native call for decode and verify forwards (decoder_stack)
        self.native_stack: LayerStack | None = None
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
        self.rotary = Rotary(config, self.shape.head_dim, device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        assert self.rotary is not None, "call init_rotary first"
        x = self.embed_tokens(input_ids)
        rope = self.rotary.tables(positions, x.dtype)
        if self.native_stack is not None and self.native_stack.accepts(x, meta):
            return self.native_stack(x, rope, kv_caches, meta)
        run_layers = self.compiled_layers or self.run_layers
        return run_layers(x, rope, kv_caches, meta)

    def run_layers(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]: the embedded tokens
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        dtype = x.dtype if residual is None else residual.dtype
        return self.norm.add_forward(x, residual, dtype)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V] fp32
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()  # [N, head_rows + len(head_extra)]
            return logits if self.head_rows == self.shape.vocab_size else self._spread(logits)
        if isinstance(self.embed_tokens, nn.Embedding):
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.embed_tokens.attend(hidden).float()  # a quantized table as the tied head

    def _spread(self, logits: torch.Tensor) -> torch.Tensor:  # [N, scored] -> [N, V], -inf filled
        out = logits.new_full((logits.shape[0], self.shape.vocab_size), -float("inf"))
        out[:, : self.head_rows] = logits[:, : self.head_rows]
        out[:, self.head_extra] = logits[:, self.head_rows :]
        return out

    def shard_sizes(self, module_name: str) -> list[int]:
        """Output rows of each shard of a linear layer (q/k/v and gate/up are fused)."""
        s = self.shape
        if module_name.endswith("qkv_proj"):
            return [s.q_size, s.kv_size, s.kv_size]
        if module_name.endswith("gate_up_proj"):
            return [s.intermediate_size] * 2
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
