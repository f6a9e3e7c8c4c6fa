"""SmolLM3 (SmolLM3ForCausalLM) served exactly: Llama's layer, but the layers whose
`no_rope_layers` entry is 0 attend without rotary embedding (NoPE; the config fills the list
from `no_rope_layer_interval`, every fourth layer by default); against transformers' own SmolLM3
on tiny random models in float32. Its optional sliding window is refused by name."""

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
from tiny import make_tiny_model, tiny_config

from engine.model.families import build_decoder
from engine.model.loader import load_model

SMOLLM3 = dict(family="smollm3", num_layers=4, no_rope_layer_interval=2)  # layers 1 and 3 NoPE
ATOL = 1e-4


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("smollm3"), seed=0, **SMOLLM3)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer SmolLM3 draft, other weights (seed 1), its second layer NoPE."""
    draft = SMOLLM3 | dict(num_layers=2)
    return make_tiny_model(tmp_path_factory.mktemp("smollm3-draft"), seed=1, **draft)  # type: ignore[arg-type]


def test_nope_layers_follow_the_config_rule(smol_dir: Path) -> None:
    loaded = load_model(str(smol_dir))
    assert loaded.architecture == "SmolLM3ForCausalLM"
    assert loaded.hf_config.no_rope_layers == [1, 0, 1, 0]
    shape = build_decoder(loaded.architecture, loaded.hf_config).shape
    assert shape.no_rope_layers == (1, 3) and not shape.layers_alike
    assert shape.tie_word_embeddings and not (shape.qkv_bias or shape.qk_norm)
    default = tiny_config("smollm3", vocab_size=32, eos_token_id=0, num_layers=8)  # interval 4
    assert build_decoder("SmolLM3ForCausalLM", default).shape.no_rope_layers == (3, 7)


@pytest.mark.parametrize("no_rope_layers", [None, [0, 1, 1, 0]])
def test_logits_match_transformers(
    no_rope_layers: list[int] | None, smol_dir: Path, tmp_path: Path
) -> None:
    """The interval's layers, or a list given outright (its first layer NoPE)."""
    model_dir = smol_dir
    if no_rope_layers is not None:
        config = SMOLLM3 | dict(no_rope_layers=no_rope_layers)
        model_dir = make_tiny_model(tmp_path / "listed", seed=3, **config)  # type: ignore[arg-type]
    assert_logits_match_transformers(model_dir, ATOL)


@pytest.mark.parametrize("uses_rope", [[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 0, 1]])
def test_the_nope_rule_matters(uses_rope: list[int], smol_dir: Path) -> None:
    """The same weights with every layer rotating, or other layers NoPE, give other logits: the
    test above would see the rule read wrongly."""
    loaded, ids = load_model(str(smol_dir)), prompt_ids(20, seed=4)
    other = load_model(str(smol_dir)).hf_config
    other.no_rope_layers = uses_rope
    diff = max_diff(runner_logits(replace(loaded, hf_config=other), ids), hf_logits(smol_dir, ids))
    assert diff > 1e-2


def test_sliding_window_is_refused_by_name() -> None:
    config = tiny_config(
        "smollm3", vocab_size=32, eos_token_id=0, num_layers=4, use_sliding_window=True,
        sliding_window=8,
    )  # fmt: skip
    assert "sliding_attention" in config.layer_types
    with pytest.raises(ValueError, match="use_sliding_window"):
        build_decoder("SmolLM3ForCausalLM", config)


def test_bfloat16_as_accurate_as_transformers(smol_dir: Path) -> None:
    """The NoPE layers' identity rope changes nothing in bfloat16 either: our error against
    float32 is no worse than transformers' own (on this CPU they are equal)."""
    assert_bf16_as_accurate_as_transformers(smol_dir)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, smol_dir: Path, draft_dir: Path) -> None:
    assert_greedy_equals_transformers(kind, smol_dir, draft_dir)
