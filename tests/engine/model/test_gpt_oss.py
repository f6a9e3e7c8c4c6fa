"""gpt-oss (GptOssForCausalLM) served exactly: biased attention with a sink logit per head, layers
alternating a sliding window with full attention, YaRN rope, and in every layer routed experts
(top k of the router's biased logits, a softmax over those k) whose SwiGLU is clamped; against
transformers' own gpt-oss on tiny random models in float32, greedy batched with and without
speculation."""

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

from engine.model import runner as runner_module
from engine.model.families import build_decoder
from engine.model.loader import load_model
from engine.model.moe import ClampedSwiGLUExpert, MoE

WINDOW = 8
GPT_OSS = dict(
    family="gpt_oss",
    num_layers=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    intermediate_size=32,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention"] * 2,
    swiglu_limit=0.5,  # low, so that the random activations reach the clamps
    rope_parameters={
        "rope_type": "yarn",
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
        "rope_theta": 150000.0,
    },
)
ATOL = 1e-4


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss"), seed=0, **GPT_OSS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer gpt-oss draft (one window layer, one full) with other weights (seed 1)."""
    draft = GPT_OSS | dict(num_layers=2, layer_types=["sliding_attention", "full_attention"])
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss-draft"), seed=1, **draft)  # type: ignore[arg-type]


def test_switches_follow_the_config(oss_dir: Path) -> None:
    loaded = load_model(str(oss_dir))
    assert loaded.architecture == "GptOssForCausalLM"
    model = build_decoder(loaded.architecture, loaded.hf_config)
    s = model.shape
    assert s.attention_sinks and s.qkv_bias and s.o_bias and not s.qk_norm
    assert s.sliding_window == WINDOW and s.is_sliding(0) and not s.is_sliding(1)
    assert s.moe is not None and s.moe.topk_then_softmax and s.moe.router_bias
    moe = model.layers[0].mlp
    assert isinstance(moe, MoE) and isinstance(moe.experts[0], ClampedSwiGLUExpert)


def test_logits_match_transformers(oss_dir: Path) -> None:
    """Prompt chunks past the window, a verify query and decodes (family_utils.runner_logits)."""
    assert_logits_match_transformers(oss_dir, ATOL)


@pytest.mark.parametrize("change", ["no sinks", "no clamp", "no window"])
def test_each_switch_matters(change: str, oss_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same weights with one of gpt-oss's departures undone give other logits: the test
    above would see it dropped."""
    loaded, ids = load_model(str(oss_dir)), prompt_ids(30, seed=4)
    config = load_model(str(oss_dir)).hf_config
    if change == "no clamp":
        config.swiglu_limit = 1e4
    if change == "no window":
        config.sliding_window = 1000
    if change == "no sinks":
        build = runner_module._build_model

        def without_sinks(*args: object) -> object:
            model = build(*args)  # type: ignore[arg-type]
            for layer in model.layers:
                layer.self_attn.sinks = None  # type: ignore[union-attr]
            return model

        monkeypatch.setattr(runner_module, "_build_model", without_sinks)
    ours = runner_logits(replace(loaded, hf_config=config), ids)
    assert max_diff(ours, hf_logits(oss_dir, ids)) > 1e-2


def test_bfloat16_as_accurate_as_transformers(oss_dir: Path) -> None:
    """Its norms multiply by the weight in float32 and round after (`norm_late_round`), as
    GptOssRMSNorm does: in bfloat16 our error against float32 is no worse than transformers'."""
    assert_bf16_as_accurate_as_transformers(oss_dir)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, oss_dir: Path, draft_dir: Path) -> None:
    """Six requests batched, prompts in chunks of at most 9 tokens, prefix caching on."""
    assert_greedy_equals_transformers(kind, oss_dir, draft_dir)
