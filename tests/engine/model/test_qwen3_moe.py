"""Qwen3-MoE (Qwen3MoeForCausalLM) served exactly: Qwen3's layer with a routed MLP (engine.model.moe),
top-k of softmax router probabilities, renormalized where `norm_topk_prob` says, an expert's
rows grouped into one call; against transformers' own Qwen3-MoE on tiny random models in
float32, greedy batched with and without speculation, and a sampled distribution by chi-square."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_utils import chi_square_pvalue, hf_model, make_engine, random_prompts
from family_utils import (
    assert_greedy_equals_transformers,
    assert_logits_match_transformers,
    hf_logits,
    max_diff,
    prompt_ids,
    runner_logits,
)
from tiny import make_tiny_model

from engine.config import SpeculativeConfig
from engine.model.families import build_decoder
from engine.model.loader import load_model
from engine.model.moe import MoE, _rows_by_expert
from engine.sample.sampling_params import SamplingParams

# 8 experts, 2 a token; layer 1 keeps a dense MLP (mlp_only_layers), as the config allows
QWEN3_MOE = dict(
    family="qwen3_moe",
    num_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)
ATOL = 1e-4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3-moe"), seed=0, **QWEN3_MOE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer Qwen3-MoE draft with other weights (seed 1)."""
    draft = QWEN3_MOE | dict(num_layers=1, mlp_only_layers=[])
    return make_tiny_model(tmp_path_factory.mktemp("qwen3-moe-draft"), seed=1, **draft)  # type: ignore[arg-type]


def test_routed_layers_follow_the_config(moe_dir: Path) -> None:
    loaded = load_model(str(moe_dir))
    assert loaded.architecture == "Qwen3MoeForCausalLM"
    model = build_decoder(loaded.architecture, loaded.hf_config)
    assert model.shape.moe is not None and model.shape.moe.layers == (0, 2)
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [True, False, True]
    assert model.shape.qk_norm and not model.shape.layers_alike  # no native stack or graph


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(norm_topk_prob: bool, tmp_path: Path) -> None:
    model_dir = make_tiny_model(
        tmp_path / "m",
        seed=2,
        **QWEN3_MOE | dict(norm_topk_prob=norm_topk_prob, tie_word_embeddings=False),  # type: ignore[arg-type]
    )
    assert_logits_match_transformers(model_dir, ATOL)


def test_norm_topk_prob_matters(moe_dir: Path) -> None:
    """The same weights without the renormalization give other logits: the test above would
    see it dropped."""
    loaded, ids = load_model(str(moe_dir)), prompt_ids(20, seed=4)
    plain = load_model(str(moe_dir)).hf_config
    plain.norm_topk_prob = False
    ours = runner_logits(replace(loaded, hf_config=plain), ids)
    assert max_diff(ours, hf_logits(moe_dir, ids)) > 1e-2


def test_rows_grouped_by_expert_once_each() -> None:
    """Every chosen expert is called once, with all its rows, in expert order: a verify's rows
    read each expert's weights once."""
    ids = torch.tensor([[3, 1], [1, 5], [5, 3], [1, 0]])
    groups = _rows_by_expert(ids, 8)
    assert [g[0] for g in groups] == [0, 1, 3, 5]
    assert [g[1].tolist() for g in groups] == [[3], [0, 1, 3], [0, 2], [1, 2]]
    for expert, rows, slots in groups:
        assert (ids.view(-1)[slots] == expert).all() and (slots // 2 == rows).all()


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, moe_dir: Path, draft_dir: Path) -> None:
    """Six requests batched, prompts in chunks of at most 9 tokens, prefix caching on."""
    assert_greedy_equals_transformers(kind, moe_dir, draft_dir)


TEMPERATURE = 1.5
NUM_SAMPLES = 1500


def _exact_pair_probs(model_dir: Path, prompt: list[int]) -> np.ndarray:
    """P(t1, t2) under the target at TEMPERATURE, exactly, from transformers' logits."""
    model = hf_model(model_dir)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / TEMPERATURE, -1)
        batch = torch.tensor([prompt + [t] for t in range(first.shape[0])])
        second = torch.softmax(model(batch).logits[:, -1] / TEMPERATURE, -1)
    return (first[:, None] * second).double().numpy()  # [vocab, vocab]


def test_sampled_pairs_follow_the_target_distribution(moe_dir: Path, draft_dir: Path) -> None:
    """With the MoE draft proposing t2 in the step after the prompt's, the pair (t1, t2) went
    through rejection sampling: its distribution is the target's."""
    prompt = random_prompts(1, (6, 6), 300, seed=47)[0]
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=2, draft_model=str(draft_dir), adaptive=False
    )
    engine = make_engine(
        moe_dir, speculative=spec, num_kv_blocks=4096, max_num_seqs=256,
        max_num_batched_tokens=4096,
    )  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True)
    seqs = engine.generate([prompt] * NUM_SAMPLES, [params] * NUM_SAMPLES)
    pairs = [(s.output_token_ids[0], s.output_token_ids[1]) for s in seqs]
    drafted = sum(s.spec.num_draft_tokens for s in seqs)
    assert drafted >= NUM_SAMPLES and len(set(pairs)) > 10
    assert chi_square_pvalue(pairs, _exact_pair_probs(moe_dir, prompt)) > 1e-3
