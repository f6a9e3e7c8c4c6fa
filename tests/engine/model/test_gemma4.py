"""Gemma 4's text decoder (Gemma4ForCausalLM) served exactly: Gemma 3's layer with norms that
scale by the weight, attention scale 1, a weightless norm on the values, learned layer scalars,
soft-capped logits, and full-attention layers of their own head size and KV heads (values from the
key projection, `attention_k_eq_v`) with the proportional rope; E2B/E4B's per-layer embeddings and
KV-shared layers (engine/model/gemma4.py); against transformers' own on tiny random models in
float32. The MoE block (26B-A4B) is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from family_utils import (
    assert_bf16_as_accurate_as_transformers,
    assert_greedy_equals_transformers,
    assert_logits_match_transformers,
    hf_logits,
    max_diff,
    prompt_ids,
    runner_logits,
)
from tiny import make_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from engine.model.families import build_decoder
from engine.model.gemma4 import Gemma4Model, SharedKVAttention
from engine.model.loader import load_model
from engine.model.runner import ModelRunner
from engine.model.sharding import check_shardable

WINDOW = 8
LOCAL, FULL = "sliding_attention", "full_attention"
GEMMA4 = dict(
    num_layers=4,
    layer_types=[LOCAL, LOCAL, LOCAL, FULL],
    sliding_window=WINDOW,
    tie_word_embeddings=True,
    global_head_dim=32,  # the local layers' head_dim is 16
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0,
    final_logit_softcapping=30.0,
)
ATOL = 1e-4


def _tiny_gemma4(path: Path, seed: int, **config: object) -> Path:
    """make_tiny_model's Gemma 4 with layer scalars away from 1 (they start at 1)."""
    make_tiny_model(path, "gemma4", seed=seed, **(GEMMA4 | config))  # type: ignore[arg-type]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.3 * i)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_gemma4(tmp_path_factory.mktemp("gemma4"), seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer Gemma 4 draft (its one layer global, as Gemma 4's last must be), seed 1."""
    return _tiny_gemma4(
        tmp_path_factory.mktemp("gemma4-draft"), 1, num_layers=1, layer_types=[FULL]
    )


def test_gemma4_switches_and_its_global_layers_own_sizes(gemma4_dir: Path) -> None:
    loaded = load_model(str(gemma4_dir))
    assert loaded.architecture == "Gemma4ForCausalLM"
    s = build_decoder(loaded.architecture, loaded.hf_config).shape
    assert s.norm_late_round and not s.norm_offset and s.v_norm and s.layer_scalar
    assert s.attention_scale == 1.0 and s.final_logit_softcapping == 30.0
    assert (s.head_dim, s.num_kv_heads) == (16, 2)
    assert (s.attention_shape(3).head_dim, s.attention_shape(3).num_kv_heads) == (32, 1)
    assert s.attention_shape(0) is s
    runner = ModelRunner(loaded, "cpu", "float32", 4)
    runner.allocate_kv_cache(8)
    assert [k.shape for k, _ in runner.kv_caches] == [(2, 8, 4, 16)] * 3 + [(1, 8, 4, 32)]
    assert runner.kv_bytes_per_block == 2 * (3 * 2 * 16 + 32) * 4 * 4


def test_logits_match_transformers(gemma4_dir: Path) -> None:
    """Prompts past the window, through prompt chunks, a verify query and single decodes."""
    assert_logits_match_transformers(gemma4_dir, ATOL)


def test_softcapping_matters(gemma4_dir: Path) -> None:
    loaded, ids = load_model(str(gemma4_dir)), prompt_ids(20, seed=4)
    uncapped = load_model(str(gemma4_dir)).hf_config
    uncapped.final_logit_softcapping = None
    ours = runner_logits(replace(loaded, hf_config=uncapped), ids)
    assert max_diff(ours, hf_logits(gemma4_dir, ids)) > 1e-2


def test_bfloat16_as_accurate_as_transformers(gemma4_dir: Path) -> None:
    assert_bf16_as_accurate_as_transformers(gemma4_dir)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, gemma4_dir: Path, draft_dir: Path) -> None:
    assert_greedy_equals_transformers(kind, gemma4_dir, draft_dir)


@pytest.mark.parametrize(
    "setting",
    [
        dict(enable_moe_block=True, num_experts=2, top_k_experts=1, moe_intermediate_size=32),
        dict(use_bidirectional_attention="vision"),
    ],
    ids=["moe", "bidirectional"],
)
def test_what_the_moe_model_adds_is_refused(setting: dict[str, object], gemma4_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(gemma4_dir), **setting)
    with pytest.raises(ValueError, match=f"Gemma4ForCausalLM with {next(iter(setting))}"):
        build_decoder("Gemma4ForCausalLM", config)


def test_tensor_parallelism_is_refused(gemma4_dir: Path) -> None:
    loaded = load_model(str(gemma4_dir))
    with pytest.raises(ValueError, match="Gemma 4"):
        check_shardable(build_decoder(loaded.architecture, loaded.hf_config).shape, 2)


# E2B/E4B's additions: per-layer embeddings, the last two layers KV-shared with double-wide MLPs
SMALL = dict(
    num_layers=6,
    layer_types=[LOCAL, LOCAL, FULL, LOCAL, LOCAL, FULL],
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=400,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_gemma4(tmp_path_factory.mktemp("gemma4-small"), 2, **SMALL)


def test_small_models_share_kv_and_take_per_layer_inputs(small_dir: Path) -> None:
    """Layers 4 and 5 attend to the K/V of layers 3 and 2 (the last earlier of their type)."""
    loaded = load_model(str(small_dir))
    model = build_decoder(loaded.architecture, loaded.hf_config)
    assert isinstance(model, Gemma4Model)
    assert model.extras.kv_sources == (0, 1, 2, 3, 3, 2) and model.extras.per_layer_size == 8
    assert isinstance(model.layers[4].self_attn, SharedKVAttention)
    assert model.layers[5].mlp.intermediate_size == 2 * model.layers[0].mlp.intermediate_size


def test_small_model_logits_match_transformers(small_dir: Path) -> None:
    loaded = load_model(str(small_dir))
    for seed, n in ((1, 40), (2, 13)):
        ids = prompt_ids(n, seed)
        diff = max_diff(runner_logits(loaded, ids), hf_logits(small_dir, ids))
        assert diff < ATOL, f"max abs diff {diff}"


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_small_model_greedy_equals_transformers(
    kind: str, small_dir: Path, draft_dir: Path
) -> None:
    assert_greedy_equals_transformers(kind, small_dir, draft_dir)
