"""A tiny hybrid Qwen3.5 written as llama.cpp's converter writes a `qwen35` GGUF
(conversion/qwen.py: Qwen3_5TextModel), and the transformers reference holding the file's weights.

The converter's transforms, applied here in its order: the v heads reordered from grouped by k
head to tiled (_LinearAttentionVReorderBase), then A_log -> -exp(A_log), dt_bias -> dt_proj.bias,
conv1d squeezed, every norm but linear_attn.norm stored as 1 + w (Qwen3NextModel). Matrices in
the file's type, vectors and the conv kernel in F32 (as the converter keeps them). When the
vendored llama.cpp of the `llama-server` make target is present, `run_converter` runs the
converter itself, so a test can check that these files are byte for byte its files.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf_blocks import finish, save_reference
from safetensors.torch import load_file
from tiny import _gguf_hparams, _gguf_tokenizer

ARCH = gguf.MODEL_ARCH.QWEN35
MROPE_SECTIONS = [11, 11, 10, 0]  # the converter's default for Qwen3.5 (text: plain rope)
# the converter, vendored in the llama-cpp-python sdist that `make llama-server` unpacks
CONVERTERS = sorted(Path(sys.prefix).glob("llama-server/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
# converter run offline on the tiny tokenizer, which its pre-tokenizer table does not know
_RUN_CONVERTER = """
import sys
sys.path.insert(0, {root!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf as convert
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert.main()
"""


def run_converter(src: Path, out: Path, kind: T) -> Path:
    """llama.cpp's own converter on `src` (no MTP layers: the tiny model has none)."""
    script = _RUN_CONVERTER.format(root=str(CONVERTERS[-1].parent))
    outtype = {T.F32: "f32", T.Q8_0: "q8_0"}[kind]
    args = [str(src), "--outtype", outtype, "--no-mtp", "--outfile", str(out)]
    subprocess.run([sys.executable, "-c", script, *args], check=True, capture_output=True)
    return out


def write_qwen35_gguf(path: Path, src: Path, kind: T) -> Path:
    """`src` (a Qwen3_5ForCausalLM folder) as the converter lays it out, matrices in `kind`."""
    config = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCH])
    _metadata(writer, config)
    _gguf_tokenizer(writer, src)
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        array = to_file(name, tensor.float(), config).numpy()
        if array.ndim == 2 and "conv1d" not in name and kind != T.F32:
            writer.add_tensor(
                gguf_name(name, config), gguf.quants.quantize(array, kind), raw_dtype=kind
            )
        else:
            writer.add_tensor(gguf_name(name, config), array)
    finish(writer)
    return path


def _metadata(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    _gguf_hparams(writer, config)
    head_dim = config["head_dim"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_value_head_dim"] * config["linear_num_value_heads"])
    recurrent = [t == "linear_attention" for t in config["layer_types"]]
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent)
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    partial = config["rope_parameters"].get("partial_rotary_factor", 0.25)
    writer.add_rope_dimension_count(int(head_dim * partial))
    writer.add_rope_dimension_sections(MROPE_SECTIONS)


def gguf_name(hf_name: str, config: dict[str, Any]) -> str:
    names = gguf.get_tensor_name_map(ARCH, config["num_hidden_layers"])
    hf_name = hf_name.replace(".dt_bias", ".dt_proj.bias")
    found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert found is not None, hf_name
    return found


def _heads(config: dict[str, Any]) -> tuple[int, int, int, int]:
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    return (
        k_heads,
        v_heads // k_heads,
        config["linear_key_head_dim"],
        config["linear_value_head_dim"],
    )


def _regroup(x: torch.Tensor, dim: int, outer: int, inner: int, size: int) -> torch.Tensor:
    """Split `dim` as [outer, inner, size] and swap outer and inner: grouped -> tiled with
    (k heads, v per k), and back with (v per k, k heads)."""
    shape = list(x.shape)
    split = x.reshape(*shape[:dim], outer, inner, size, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


def _reorder(name: str, x: torch.Tensor, config: dict[str, Any], to_file: bool) -> torch.Tensor:
    """The converter's v-head reorder (to_file) or its inverse, on one linear_attn tensor."""
    k_heads, per_k, k_dim, v_dim = _heads(config)
    if per_k == 1 or "linear_attn." not in name:
        return x
    outer, inner = (k_heads, per_k) if to_file else (per_k, k_heads)
    qk = 2 * k_heads * k_dim
    if "in_proj_qkv" in name or "conv1d" in name:  # the v rows (channels) only
        return torch.cat([x[:qk], _regroup(x[qk:], 0, outer, inner, v_dim)])
    if "in_proj_z" in name:
        return _regroup(x, 0, outer, inner, v_dim)
    if any(p in name for p in ("in_proj_a", "in_proj_b", "A_log", "dt_bias")):
        return _regroup(x, 0, outer, inner, 1)
    if "out_proj" in name:
        return _regroup(x, 1, outer, inner, v_dim)
    return x  # linear_attn.norm: one v head's width, shared


def to_file(name: str, x: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """A transformers tensor as the converter stores it."""
    x = _reorder(name, x, config, to_file=True)
    if name.endswith(".A_log"):
        return -torch.exp(x)
    if "conv1d" in name:
        return x.squeeze()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return x + 1
    return x


def from_file(name: str, x: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """The file's (dequantized) tensor as transformers holds it: `to_file` undone."""
    if name.endswith(".A_log"):
        x = torch.log(-x.double()).float()
    elif "conv1d" in name:
        x = x[:, None, :]
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        x = x - 1
    return _reorder(name, x, config, to_file=False)


def qwen35_reference(path: Path, src: Path, out: Path) -> Path:
    """A transformers folder of `src`'s config holding the GGUF at `path`'s weights, as gguf's
    own reader dequantizes them, in transformers' layout."""
    config = json.loads((src / "config.json").read_text())
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    ref = {}
    for name, like in load_file(str(src / "model.safetensors")).items():
        t = tensors[gguf_name(name, config)]
        raw = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        value = torch.from_numpy(raw.copy()).reshape(to_file(name, like, config).shape)
        ref[name] = from_file(name, value, config).numpy()
    return save_reference(src, out, ref)
