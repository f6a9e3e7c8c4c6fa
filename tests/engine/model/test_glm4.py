"""GLM-4 (Glm4ForCausalLM) served exactly: Gemma's four norms a layer under GLM's names, q/k/v
biases, gate/up fused in the checkpoint, and half of each head rotating in the interleaved layout
(q and k rows reordered at load onto the decoder's rope); against transformers' own GLM-4 on tiny
random models in float32 (and bfloat16 no less accurate than transformers')."""

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
from tiny import CHAT_TEMPLATE, make_tiny_model
from transformers import AutoConfig

from engine.model.families import build_decoder
from engine.model.family_switches import interleaved_order
from engine.model.loader import load_model
from engine.model.rope import partial_rotary_factor

GLM4 = dict(num_layers=3)  # transformers' defaults: partial_rotary_factor 0.5, attention_bias
ATOL = 1e-4


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("glm4"), "glm4", seed=0, **GLM4)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer GLM-4 draft, other weights (seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("glm4-draft"), "glm4", seed=1, num_layers=1)


def test_glm4_is_the_decoder_with_sandwich_norms(glm4_dir: Path) -> None:
    loaded = load_model(str(glm4_dir))
    assert loaded.architecture == "Glm4ForCausalLM"
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE  # the checkpoint's own
    config = loaded.hf_config
    assert config.attention_bias and partial_rotary_factor(config) == 0.5
    s = build_decoder(loaded.architecture, config).shape
    assert s.sandwich_norms and s.qkv_bias and not (s.o_bias or s.qk_norm or s.norm_offset)
    names = [name for name, _ in loaded.iter_weights()]
    assert "model.layers.0.pre_feedforward_layernorm.weight" in names
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert not any("post_mlp" in n or "post_self_attn" in n or "gate_up" in n for n in names)


def test_interleaved_pairs_land_on_the_decoders_pairs() -> None:
    """Head dim 8 with 4 rotating: GLM's pairs (0, 1), (2, 3) become (0, 4), (1, 5); the passed
    dims 4..7 the unrotated pairs (2, 6), (3, 7)."""
    assert interleaved_order(8, 4).tolist() == [0, 2, 4, 5, 1, 3, 6, 7]
    assert interleaved_order(4, 4).tolist() == [0, 2, 1, 3]


def test_logits_match_transformers(glm4_dir: Path) -> None:
    assert_logits_match_transformers(glm4_dir, ATOL)


def test_the_rotary_layout_matters(glm4_dir: Path) -> None:
    """The same weights rotating every dim give other logits: the test above sees the order."""
    loaded, ids = load_model(str(glm4_dir)), prompt_ids(20, seed=4)
    whole = load_model(str(glm4_dir)).hf_config
    whole.partial_rotary_factor = 1.0
    whole.rope_parameters = {**whole.rope_parameters, "partial_rotary_factor": 1.0}
    ours = runner_logits(replace(loaded, hf_config=whole), ids)
    assert max_diff(ours, hf_logits(glm4_dir, ids)) > 1e-2


def test_bfloat16_as_accurate_as_transformers(glm4_dir: Path) -> None:
    assert_bf16_as_accurate_as_transformers(glm4_dir)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, glm4_dir: Path, draft_dir: Path) -> None:
    assert_greedy_equals_transformers(kind, glm4_dir, draft_dir)


def test_unsupported_variants_are_refused_by_name(glm4_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(glm4_dir))
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="Glm4ForCausalLM.*silu"):
        build_decoder("Glm4ForCausalLM", config)
    assert torch.equal(interleaved_order(16, 16)[:8], torch.arange(0, 16, 2))
