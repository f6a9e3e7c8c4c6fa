"""OLMo 2 (Olmo2ForCausalLM) served exactly: norms only after each sublayer, q/k norms over the
whole projection, every norm's weight applied in float32 before rounding; against transformers'
own OLMo 2 on tiny random models in float32 (and bfloat16 no less accurate than transformers')."""

from __future__ import annotations

from pathlib import Path

import pytest
from family_utils import (
    assert_bf16_as_accurate_as_transformers,
    assert_greedy_equals_transformers,
    assert_logits_match_transformers,
)
from tiny import CHAT_TEMPLATE, make_tiny_model
from transformers import AutoConfig

from engine.model.families import build_decoder
from engine.model.loader import load_model
from engine.model.norms import FlatNorm, NoNorm
from engine.model.shape import DecoderShape
from engine.model.sharding import check_shardable

OLMO2 = dict(num_layers=3)
ATOL = 1e-4


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("olmo2"), "olmo2", seed=0, **OLMO2)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer OLMo 2 draft, other weights (seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("olmo2-draft"), "olmo2", seed=1, num_layers=1)


def test_olmo2_is_the_decoder_with_post_norms_only(olmo2_dir: Path) -> None:
    loaded = load_model(str(olmo2_dir))
    assert loaded.architecture == "Olmo2ForCausalLM"
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE  # the checkpoint's own
    model = build_decoder(loaded.architecture, loaded.hf_config)
    s = model.shape
    assert s.sandwich_norms and not s.pre_norms and s.qk_norm_flat and s.norm_late_round
    layer = model.layers[0]
    assert isinstance(layer.input_layernorm, NoNorm)
    assert isinstance(layer.pre_feedforward_layernorm, NoNorm)
    assert isinstance(layer.self_attn.q_norm, FlatNorm)
    assert layer.self_attn.q_norm.weight.shape == (s.q_size,)
    assert layer.self_attn.k_norm.weight.shape == (s.kv_size,)


def test_logits_match_transformers(olmo2_dir: Path) -> None:
    assert_logits_match_transformers(olmo2_dir, ATOL)


def test_bfloat16_as_accurate_as_transformers(olmo2_dir: Path) -> None:
    """Each norm's weight applied in float32 before rounding, as Olmo2RMSNorm does."""
    assert_bf16_as_accurate_as_transformers(olmo2_dir)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, olmo2_dir: Path, draft_dir: Path) -> None:
    assert_greedy_equals_transformers(kind, olmo2_dir, draft_dir)


def test_unsupported_variants_are_refused_by_name(olmo2_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(olmo2_dir))
    config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="Olmo2ForCausalLM.*silu"):
        build_decoder("Olmo2ForCausalLM", config)
    shape = build_decoder("Olmo2ForCausalLM", AutoConfig.from_pretrained(str(olmo2_dir))).shape
    assert isinstance(shape, DecoderShape)
    with pytest.raises(ValueError, match="OLMo 2"):  # a q/k norm's mean spans every head
        check_shardable(shape, 2)


def test_norm_rounds_as_olmo2s_in_bfloat16() -> None:
    """Olmo2RMSNorm multiplies by its weight in float32 and rounds after: bit for bit the same
    here, where rounding before the weight (Llama's) gives other values."""
    import torch
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from engine.model.norms import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    theirs = Olmo2RMSNorm(64, 1e-6)
    ours, early = RMSNorm(64, 1e-6, late_round=True), RMSNorm(64, 1e-6)
    with torch.no_grad():
        weight = 1 + 0.3 * torch.randn(64, generator=gen)
        for norm in (theirs, ours, early):
            norm.weight.copy_(weight)
        early.to(torch.bfloat16)
        assert torch.equal(ours(x), theirs(x))
        assert not torch.equal(early(x), theirs(x))
