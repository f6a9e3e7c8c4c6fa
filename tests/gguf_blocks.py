"""Well-formed random GGUF blocks and tiny GGUF files made of them, for the native kernel tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file
from tiny import _gguf_hparams, _gguf_tokenizer

_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # f16 d (and dmin) per block


def random_blocks(
    qtype: T, n: int, k: int, seed: int = 0, scale: float | None = None, low: float = 1e-3
) -> torch.Tensor:
    """[n, bytes per row]: random bits, f16 scales uniform in [low, 20 low] (or all `scale`);
    MXFP4's E8M0 scales the powers of two nearest those (`scale` must be one)."""
    rng = np.random.default_rng(seed)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    if qtype == T.MXFP4:  # one E8M0 byte e per block: w = 2^(e - 128) * value
        shape = raw.shape[:2]
        d = np.full(shape, scale) if scale is not None else rng.uniform(low, 20 * low, shape)
        raw[:, :, 0] = np.round(np.log2(d)).astype(np.int32) + 128
        return torch.from_numpy(raw.reshape(n, -1))
    for offset in _SCALE_OFFSETS.get(qtype, (0,)):
        shape = raw.shape[:2]
        d = np.full(shape, scale) if scale is not None else rng.uniform(low, 20 * low, shape)
        raw[:, :, offset : offset + 2] = d.astype(np.float16).view(np.uint8).reshape(*shape, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def finish(writer: gguf.GGUFWriter) -> None:
    """The header, the metadata and the tensors out; the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def save_reference(src: Path, out: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A model folder at `out`: `src`'s config and tokenizer files, `tensors` its weights (the
    GGUF's values as gguf's own reader dequantizes them, under transformers' names)."""
    out.mkdir(exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            (out / file.name).write_bytes(file.read_bytes())
    weights = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in tensors.items()}
    save_file(weights, str(out / "model.safetensors"))
    return out


def rounded_reference(ref: Path, keep: Callable[[str], bool] = lambda name: False) -> Path:
    """`ref` beside itself with its weights rounded to bfloat16 as `quantization: none`'s
    conversion stores them (those `keep` names left in float32)."""
    out = ref.with_name(f"{ref.name}-bf16")
    if not out.exists():
        tensors = load_file(str(ref / "model.safetensors"))
        rounded = {n: t if keep(n) else t.bfloat16().float() for n, t in tensors.items()}
        save_reference(ref, out, {n: t.numpy() for n, t in rounded.items()})
    return out


def write_random_gguf(path: Path, src: Path, kinds: list[T]) -> None:
    """The tiny model at `src` as a GGUF whose matrices take `kinds` in turn (norms, biases F32),
    with small scales so that activations stay in range."""
    from safetensors.torch import load_file

    config = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "qwen2")
    _gguf_hparams(writer, config)
    _gguf_tokenizer(writer, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config["num_hidden_layers"])
    matrices = 0
    for i, (name, tensor) in enumerate(sorted(load_file(str(src / "model.safetensors")).items())):
        base, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if array.ndim == 2:
            kind = kinds[matrices % len(kinds)]
            matrices += 1
            low = 1e-4 if kind in _SCALE_OFFSETS else 2e-3
            blocks = random_blocks(kind, *array.shape, seed=i, low=low).numpy()
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", blocks, raw_dtype=kind)
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
    finish(writer)


def write_gemma3_gguf(path: Path, src: Path, kind: T) -> None:
    """The tiny Gemma 3 at `src` laid out as llama.cpp's converter writes it: its metadata keys
    (the global layers' rope theta and linear scaling only; no local rope, layer types or
    attention scale, which llama.cpp derives), norms stored as 1 + w in F32, every matrix in
    `kind` (F32, or quantized by gguf's own reference), the embedding tied (no output.weight)."""
    from safetensors.torch import load_file

    config = json.loads((src / "config.json").read_text())
    rope = config["rope_parameters"]["full_attention"]
    writer = gguf.GGUFWriter(str(path), "gemma3")
    _gguf_hparams(writer, config | {"rope_parameters": rope})
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    _gguf_tokenizer(writer, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config["num_hidden_layers"])
    for name, tensor in sorted(load_file(str(src / "model.safetensors")).items()):
        base, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        target = f"{names.get_name(base)}.{suffix}"
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)  # the converter's norm_shift
        if array.ndim == 2 and kind != T.F32:
            writer.add_tensor(target, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(target, array)
    finish(writer)


def gemma3_reference(path: Path, src: Path, out: Path, bf16: bool = False) -> Path:
    """transformers' Gemma 3 of `src`'s config holding the GGUF at `path`'s weights as gguf's own
    reader dequantizes them (norms less the converter's 1; rounded to bfloat16 with `bf16`, as
    a conversion to bf16 safetensors stores them), saved at `out` in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, model.config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base, suffix = name.rsplit(".", 1)
            t = tensors[f"{names.get_name(base)}.{suffix}"]
            w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
            w = w.float().reshape(param.shape)
            w = w - 1.0 if name.endswith("norm.weight") else w
            param.copy_(w.to(torch.bfloat16).float() if bf16 else w)
    model.save_pretrained(str(out))
    return out
