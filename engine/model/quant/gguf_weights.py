"""Read a GGUF file's tensors raw, as quantized weights, under transformers' parameter names.

Q4_K becomes an `Int4Weight` of group size 32 without a float round trip: a Q4_K super-block
holds 8 sub-blocks of 32 values, w = d * sc * q - dmin * m, which is (q - 8) * scale + zero
with scale = d * sc and zero = 8 * d * sc - dmin * m. Other quantized types (Q5_0, Q5_K, Q6_K,
Q8_0, MXFP4, ...) are dequantized by `gguf` and rounded to int8 per output row. Float tensors
(norms, biases) come back as float32 tensors, Gemma's norms less the 1 llama.cpp's converter
added. With `blocks` (`quantization: gguf`), every matrix whose format the native kernels
multiply (`gguf_ops.FILE_FORMATS`, gpt-oss's MXFP4 experts among them) comes back as the file's
own bytes (`GgufBlocks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig

from engine.kernels import gguf_ops
from engine.model.quant.formats import (
    GgufBlocks,
    Int4Weight,
    QuantizedWeight,
    cat_rows,
    quantize_int8,
)
from engine.model.quant.gguf_experts import MOE_ARCHS, expert_names, num_experts, split_experts
from engine.model.quant.gguf_file import GgufTensorInfo, read_gguf
from engine.model.quant.gguf_linear_attention import (
    HYBRID_ARCHS,
    from_file,
    is_mtp_tensor,
    linear_names,
)

_Q4_K_BLOCK = 144  # bytes per 256 values: d (f16), dmin (f16), 12 bytes of scales, 128 of q
_HF_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)
# Names only some architectures hold, each in its own table: Gemma's norms after each sublayer
# (gguf maps pre_feedforward_layernorm to ffn_norm, which is post_attention_layernorm in the other
# families), OLMo 2's norm after the MLP, GLM-4's norms, and the fused q/k/v and gate/up of Phi-3
# and GLM-4 (whose ffn_up holds gate and up: up_proj is not its name there)
_FUSED_SUFFIXES = ("self_attn.qkv_proj", "mlp.gate_up_proj")
_ARCH_SUFFIXES = {
    "gemma3": ("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "olmo2": ("post_feedforward_layernorm",),
    "phi3": _FUSED_SUFFIXES,
    "glm4": ("mlp.gate_up_proj", "post_self_attn_layernorm", "post_mlp_layernorm"),
    "gemma4": (
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "layer_scalar",
        "per_layer_input_gate",
        "per_layer_projection",
        "post_per_layer_input_norm",
    ),
}
# Gemma 4's per-layer embedding table, its projection and norm, beside the usual three
_ARCH_TOP = {
    "gemma4": (
        "model.embed_tokens_per_layer",
        "model.per_layer_model_projection",
        "model.per_layer_projection_norm",
    )
}
# transformers parameters without a `.weight` (the converter added one: Gemma 4's layer scalar)
_BARE_PARAMS = ("layer_scalar",)
# tables only ever read a few rows at a time, never a head: left in the file where quantized
_ROW_TABLES = ("model.embed_tokens_per_layer.weight",)
_GATE_UP_FUSED_ARCHS = ("phi3", "glm4")
# GGUF architectures whose q/k rows llama.cpp's converter permuted (LlamaModel.permute, which
# Granite's and SmolLM3's converters inherit; transformers undoes it for llama).
_PERMUTED_ARCHS = ("llama", "granite", "smollm3")
# tensors that are config, not weights (engine.model.gguf_dense reads them)
# (and engine.model.gguf_gemma4: Gemma 4's proportional rope, as rope_freqs)
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
# GGUF architectures whose norm weights llama.cpp's converter stored as 1 + w (Gemma's norms
# scale by 1 + w): w is that minus 1 in float32, and 1 + w gives the file's value back exactly
# wherever it is at least 1/2 (Sterbenz), within half an ulp of it below that.
_NORM_SHIFTED_ARCHS = ("gemma3",)

_FLOAT_TYPES = ("F32", "F16", "BF16")
_ROWS_AT_ONCE = 16384


class GgufRows:
    """A quantized table left in the file, memory-mapped on its own: `rows` dequantizes only the
    rows asked for (exactly, as gguf does). For an untied embedding, which a forward reads a few
    rows of, this keeps ~150 MB of a Qwen vocabulary out of resident memory."""

    def __init__(self, path: Path, tensor: GgufTensorInfo) -> None:
        self.kind = tensor.tensor_type
        rows, row_bytes = tensor.data.shape
        self.raw = np.memmap(path, np.uint8, "r", offset=tensor.offset, shape=(rows, row_bytes))
        block, type_size = gguf.GGML_QUANT_SIZES[self.kind]
        self.shape = (rows, row_bytes // type_size * block)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, K] float32
        raw = self.raw[ids.cpu().numpy()]  # a copy of those rows only
        return _dequantize_raw(raw, self.kind)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        return _dequantize_raw(np.asarray(self.raw), self.kind).to(dtype)


GgufTensor = torch.Tensor | QuantizedWeight | GgufRows


def read_gguf_weights(
    path: Path, config: PretrainedConfig, exact: bool = False, blocks: bool = False
) -> Iterator[tuple[str, GgufTensor]]:
    """(transformers name, tensor or quantized weight) for every tensor of the file; with
    `exact`, every tensor dequantized to float32 by gguf's own reference (quality baselines);
    with `blocks`, the native kernels' formats kept as the file's blocks."""
    arch, tensors = read_gguf(path)
    layers = int(config.num_hidden_layers)
    names = _hf_names(arch, layers)
    if arch in MOE_ARCHS:  # stacked experts: one matrix each, named as transformers names them
        tensors = split_experts(tensors, num_experts(config))
        names |= expert_names(arch, layers, num_experts(config))
    hybrid = arch in HYBRID_ARCHS
    full_names = linear_names(layers) if hybrid else {}
    for tensor in tensors:
        if tensor.name in _CONFIG_TENSORS or (hybrid and is_mtp_tensor(tensor.name, layers)):
            continue
        base, _, suffix = tensor.name.rpartition(".")
        if tensor.name in full_names:
            hf_name = full_names[tensor.name]
        elif base in names:
            bare = names[base].endswith(_BARE_PARAMS)
            hf_name = names[base] if bare else f"{names[base]}.{suffix}"
        else:
            raise ValueError(f"{path.name}: tensor {tensor.name!r} has no transformers name")
        if exact:
            value: GgufTensor = _dequantized(tensor)
        elif _rows_suffice(hf_name, tensor, config):
            value = GgufRows(path, tensor)
        elif blocks and _native_format(tensor):
            value = _blocks(tensor)
        else:
            value = _convert(tensor)
        if arch in _PERMUTED_ARCHS and base.endswith(("attn_q", "attn_k")):
            value = _unpermute(value, _permute_heads(base, config))
        if arch == "glm4" and base.endswith(("attn_q", "attn_k")):
            value = _value_rows(value, _glm4_interleaved(value.shape[0], config))
        if arch in _NORM_SHIFTED_ARCHS and hf_name.endswith("norm.weight"):
            value = _unshifted(value, tensor.name)
        if hybrid:  # A_log, conv1d's shape, norms less 1 (gguf_linear_attention)
            value = from_file(hf_name, value)
        yield hf_name, value


def _rows_suffice(hf_name: str, tensor: GgufTensorInfo, config: PretrainedConfig) -> bool:
    """An embedding that is not also the head is only ever read a few rows at a time."""
    if tensor.tensor_type.name in _FLOAT_TYPES:
        return False
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return hf_name in _ROW_TABLES or (hf_name == "model.embed_tokens.weight" and not tied)


def _hf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF base name ("blk.0.attn_q") -> transformers base name, from gguf's own name map."""
    arch_of_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    table = gguf.get_tensor_name_map(arch_of_name[arch], num_layers)
    suffixes = _HF_SUFFIXES + _ARCH_SUFFIXES.get(arch, ())
    if arch in _GATE_UP_FUSED_ARCHS:
        suffixes = tuple(s for s in suffixes if s != "mlp.up_proj")
    hf = ["model.embed_tokens", "model.norm", "lm_head", *_ARCH_TOP.get(arch, ())]
    hf += [f"model.layers.{i}.{s}" for i in range(num_layers) for s in suffixes]
    out = {}
    for name in hf:
        gguf_name = table.get_name(name)
        if gguf_name is not None:
            out[gguf_name] = name
    return out


def _unshifted(value: GgufTensor, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"norm weight {name!r} is quantized; norms are float in a GGUF")
    return value.float() - 1.0


def _native_format(tensor: GgufTensorInfo) -> bool:
    qtype = int(tensor.tensor_type)
    if qtype not in gguf_ops.FILE_FORMATS or tensor.data.ndim != 2:
        return False
    values, nbytes = gguf_ops.FILE_FORMATS[qtype]
    return gguf_ops.supports(qtype, tensor.data.shape[1] // nbytes * values)


def _blocks(tensor: GgufTensorInfo) -> GgufBlocks:
    values, nbytes = gguf_ops.FILE_FORMATS[int(tensor.tensor_type)]
    k = tensor.data.shape[1] // nbytes * values
    raw = torch.from_numpy(np.array(tensor.data))  # a copy: the file stays closed to writes
    return GgufBlocks(raw, int(tensor.tensor_type), k, tensor.tensor_type.name)


def _convert(tensor: GgufTensorInfo) -> GgufTensor:
    kind, data = tensor.tensor_type, tensor.data
    if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if kind == gguf.GGMLQuantizationType.BF16:
        return torch.from_numpy(gguf.quants.dequantize(data, kind).copy())
    if kind == gguf.GGMLQuantizationType.Q4_K:
        return q4_k_to_int4(torch.from_numpy(np.array(data)))
    # Row by row formats: convert in slices, so a vocabulary-sized head never exists in float32.
    parts = [
        quantize_int8(_dequantize_raw(data[i : i + _ROWS_AT_ONCE], kind), source=kind.name)
        for i in range(0, data.shape[0], _ROWS_AT_ONCE)
    ]
    return parts[0] if len(parts) == 1 else cat_rows(parts)


def _dequantize_raw(data: np.ndarray, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """[N, bytes per row] -> [N, K] float32, as gguf's reference dequantization computes it."""
    if kind.name in _DEQUANTIZE:
        return _DEQUANTIZE[kind.name](torch.from_numpy(np.array(data)))
    # gguf's numpy reference: right for every type, slow on big tensors
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, kind), dtype=np.float32))


def _dequantized(tensor: GgufTensorInfo) -> torch.Tensor:
    data, kind = tensor.data, tensor.tensor_type
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, kind), dtype=np.float32))


def _q4_k_parts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K / 256 * 144] Q4_K rows -> q [N, K] uint8, scale d * sc and min dmin * m, both
    [N, K / 32] float32: w = scale * q - min."""
    n = raw.shape[0]
    blocks = raw.reshape(-1, _Q4_K_BLOCK)  # [B, 144], B = N * K / 256
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [B, 1]
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    sc, m = _q4_k_scale_min(blocks[:, 4:16])  # [B, 8] each, 6-bit integers
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # sub-blocks 2j (low nibbles), 2j+1 (high)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n, -1)
    # d * sc is exact in float32 (an f16 times a 6-bit integer), as is dmin * m
    return q, (d * sc).reshape(n, -1), (dmin * m).reshape(n, -1)


def dequantize_q4_k(raw: torch.Tensor) -> torch.Tensor:  # [N, K / 256 * 144] -> [N, K]
    q, scale, low = _q4_k_parts(raw)
    n, k = q.shape
    w = scale[..., None] * q.view(n, -1, 32).float() - low[..., None]
    return w.view(n, k)


def q4_k_to_int4(raw: torch.Tensor) -> Int4Weight:
    """[N, K / 256 * 144] uint8 Q4_K rows -> the same values as int4 group 32."""
    q, scale, low = _q4_k_parts(raw)
    zero = 8 * scale - low
    return Int4Weight(
        q,
        scale.to(torch.bfloat16),
        zero.to(torch.bfloat16),
        32,
        "Q4_K",
    )


def _q4_k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4)."""
    p = packed.reshape(-1, 3, 4)
    d, m, m_d = p[:, 0], p[:, 1], p[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _permute_heads(base: str, config: PretrainedConfig) -> int:
    heads = int(config.num_attention_heads)
    return int(getattr(config, "num_key_value_heads", None) or heads) if "attn_k" in base else heads


def _glm4_interleaved(rows: int, config: PretrainedConfig) -> torch.Tensor:  # [rows]
    """The file's rows in transformers' order: llama.cpp's converter (Glm4Model.normal_to_neox)
    wrote each head's interleaved rotary dims as two halves, evens then odds, the rest after."""
    head_dim = int(config.head_dim)
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    rotated = int(head_dim * float(factor or 0.5))  # GLM-4's default: half of each head
    dim = torch.arange(head_dim)
    in_file = torch.where(dim % 2 == 0, dim // 2, rotated // 2 + dim // 2)
    per_head = torch.where(dim < rotated, in_file, dim)
    return (torch.arange(0, rows, head_dim)[:, None] + per_head).flatten()


def _value_rows(value: GgufTensor, rows: torch.Tensor) -> GgufTensor:
    return value[rows] if isinstance(value, torch.Tensor) else value.rows(rows)


def _unpermute(value: GgufTensor, n_head: int) -> GgufTensor:
    """Undo llama.cpp's q/k row permutation (transformers' LlamaTensorProcessor)."""
    rows = value.shape[0]
    perm = torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)
    return value[perm] if isinstance(value, torch.Tensor) else value.rows(perm)


# Torch ports of gguf.quants' dequantizers for the types the bundled models use beside Q4_K
# (the numpy reference takes ~30 ns a value; these are checked against it in the tests).


def _f16(raw: torch.Tensor) -> torch.Tensor:  # [B, 2] uint8 -> [B, 1] float32
    return raw.contiguous().view(torch.float16).float()


def dequantize_q6_k(raw: torch.Tensor) -> torch.Tensor:  # [N, K / 256 * 210] -> [N, K]
    n = raw.shape[0]
    b = raw.reshape(-1, 210)
    ql, qh = b[:, :128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()  # [B, 16]
    d = _f16(b[:, 208:210]) * scales  # [B, 16]
    low = ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    low = (low & 0x0F).reshape(-1, 8, 32)
    high = qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(
        1, 1, 4, 1
    )
    high = (high & 0x03).reshape(-1, 8, 32)
    q = (low | (high << 4)).to(torch.int16) - 32  # [B, 8, 32] in -32..31
    return (d.view(-1, 16, 1) * q.view(-1, 16, 16).float()).reshape(n, -1)


def dequantize_q5_0(raw: torch.Tensor) -> torch.Tensor:  # [N, K / 32 * 22] -> [N, K]
    n = raw.shape[0]
    b = raw.reshape(-1, 22)
    d = _f16(b[:, 0:2])
    qh = b[:, 2:6].contiguous().view(torch.int32)  # [B, 1] bit i: the 5th bit of value i
    high = (qh >> torch.arange(32, dtype=torch.int32)) & 1  # [B, 32]
    qs = b[:, 6:22]
    low = torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)  # [B, 32]
    q = (low | (high << 4)) - 16
    return (d * q.float()).reshape(n, -1)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:  # [N, K / 32 * 34] -> [N, K]
    n = raw.shape[0]
    b = raw.reshape(-1, 34)
    return (_f16(b[:, 0:2]) * b[:, 2:].contiguous().view(torch.int8).float()).reshape(n, -1)


_DEQUANTIZE = {
    "Q4_K": dequantize_q4_k,
    "Q6_K": dequantize_q6_k,
    "Q5_0": dequantize_q5_0,
    "Q8_0": dequantize_q8_0,
}
