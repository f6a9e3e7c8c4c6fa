"""Well-formed random GGUF blocks and tiny GGUF files made of them, for the native kernel tests."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from tiny import _gguf_hparams, _gguf_tokenizer

_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}  # f16 d (and dmin) per block


def random_blocks(
    qtype: T, n: int, k: int, seed: int = 0, scale: float | None = None, low: float = 1e-3
) -> torch.Tensor:
    """[n, bytes per row]: random bits, f16 scales uniform in [low, 20 low] (or all `scale`)."""
    rng = np.random.default_rng(seed)
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for offset in _SCALE_OFFSETS.get(qtype, (0,)):
        shape = raw.shape[:2]
        d = np.full(shape, scale) if scale is not None else rng.uniform(low, 20 * low, shape)
        raw[:, :, offset : offset + 2] = d.astype(np.float16).view(np.uint8).reshape(*shape, 2)
    return torch.from_numpy(raw.reshape(n, -1))


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
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
