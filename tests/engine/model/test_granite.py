"""Granite (GraniteForCausalLM) served exactly: Llama's layer with four constants of its config,
embeddings times `embedding_multiplier`, `attention_multiplier` as the attention scale, each
sublayer's output times `residual_multiplier` as it joins the stream, logits divided by
`logits_scaling`; against transformers' own Granite on tiny random models in float32."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
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

from engine.model.families import build_decoder
from engine.model.loader import load_model

# each far from 1.0 (and the scale from head_dim 16's 0.25), so that dropping one shows
MULTIPLIERS = dict(
    embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=2.0
)
GRANITE = dict(family="granite", num_layers=3, **MULTIPLIERS)
ATOL = 1e-4


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("granite"), seed=0, **GRANITE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer Granite draft, other weights (seed 1), its head tied to the embeddings."""
    draft = GRANITE | dict(num_layers=1, tie_word_embeddings=True)
    return make_tiny_model(tmp_path_factory.mktemp("granite-draft"), seed=1, **draft)  # type: ignore[arg-type]


def test_granite_is_llamas_layer_with_its_multipliers(granite_dir: Path) -> None:
    loaded = load_model(str(granite_dir))
    assert loaded.architecture == "GraniteForCausalLM"
    shape = build_decoder(loaded.architecture, loaded.hf_config).shape
    assert (shape.embedding_multiplier, shape.attention_multiplier) == (6.0, 0.1)
    assert (shape.residual_multiplier, shape.logits_scaling) == (0.5, 2.0)
    assert shape.attention_scale == 0.1 and shape.layers_alike
    assert not (shape.qkv_bias or shape.qk_norm or shape.norm_offset or shape.sandwich_norms)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers(tied: bool, granite_dir: Path, tmp_path: Path) -> None:
    model_dir = granite_dir
    if tied:  # the tied head divides by logits_scaling too
        model_dir = make_tiny_model(tmp_path / "tied", seed=3, **GRANITE, tie_word_embeddings=True)  # type: ignore[arg-type]
    assert_logits_match_transformers(model_dir, ATOL)


@pytest.mark.parametrize("name", sorted(MULTIPLIERS))
def test_each_multiplier_matters(name: str, granite_dir: Path) -> None:
    """The same weights with one constant at its default give other logits: the test above
    would see a multiplier the decoder dropped."""
    loaded, ids = load_model(str(granite_dir)), prompt_ids(20, seed=4)
    plain = load_model(str(granite_dir)).hf_config
    setattr(plain, name, 1.0)
    diff = max_diff(
        runner_logits(replace(loaded, hf_config=plain), ids), hf_logits(granite_dir, ids)
    )
    assert diff > 1e-2


def test_bfloat16_as_accurate_as_transformers(granite_dir: Path) -> None:
    """Each constant applied in the model dtype where transformers applies it: in bfloat16 our
    error against float32 is no worse than transformers' own (on this CPU they are equal)."""
    assert_bf16_as_accurate_as_transformers(granite_dir)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, granite_dir: Path, draft_dir: Path) -> None:
    assert_greedy_equals_transformers(kind, granite_dir, draft_dir)
