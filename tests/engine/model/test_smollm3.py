"""SmolLM3 (SmolLM3ForCausalLM) served exactly: Llama's layer, but the layers whose
`no_rope_layers` entry is 0 attend without rotary embedding (NoPE; the config fills the list
from `no_rope_layer_interval`, every fourth layer by default); against transformers' own SmolLM3
on tiny random models in float32. Its optional sliding window is refused by name."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_greedy, hf_model, make_engine, outputs, random_prompts
from tiny import make_tiny_model, tiny_config
from transformers import AutoModelForCausalLM

from engine.config import SpeculativeConfig
from engine.model.families import build_decoder
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ForwardInput, ModelRunner

SMOLLM3 = dict(family="smollm3", num_layers=4, no_rope_layer_interval=2)  # layers 1 and 3 NoPE
ATOL = 1e-4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("smollm3"), seed=0, **SMOLLM3)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer SmolLM3 draft, other weights (seed 1), its second layer NoPE."""
    draft = SMOLLM3 | dict(num_layers=2)
    return make_tiny_model(tmp_path_factory.mktemp("smollm3-draft"), seed=1, **draft)  # type: ignore[arg-type]


def _ids(n: int, seed: int) -> list[int]:
    return random_prompts(1, (n, n), 300, seed)[0]


def _chunked(
    loaded: LoadedModel, ids: list[int], dtype: str = "float32"
) -> torch.Tensor:  # [len(ids), V]
    """Prompt chunks, a 4-token verify query and single decodes, through shuffled blocks."""
    runner, table = ModelRunner(loaded, "cpu", dtype, 4), list(range(47, -1, -1))
    runner.allocate_kv_cache(48)
    outs, pos = [], 0
    for size in (7, 1, 4, 20, 1, 100):
        chunk = ids[pos : pos + size]
        if chunk:
            outs.append(runner.forward([ForwardInput(chunk, pos, table, len(chunk))]))
        pos += len(chunk)
    return torch.cat(outs)


@torch.no_grad()
def _reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def _reference_bf16(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    return model(torch.tensor([ids])).logits[0].float()


def _max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape
    return (ours - ref).abs().max().item()


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
    loaded = load_model(str(model_dir))
    for seed, n in ((1, 40), (2, 13), (3, 33)):
        ids = _ids(n, seed)
        diff = _max_diff(_chunked(loaded, ids), _reference(model_dir, ids))
        assert diff < ATOL, f"max abs diff {diff}"


@pytest.mark.parametrize("uses_rope", [[1, 1, 1, 1], [1, 1, 1, 0], [0, 1, 0, 1]])
def test_the_nope_rule_matters(uses_rope: list[int], smol_dir: Path) -> None:
    """The same weights with every layer rotating, or other layers NoPE, give other logits: the
    test above would see the rule read wrongly."""
    loaded, ids = load_model(str(smol_dir)), _ids(20, seed=4)
    other = load_model(str(smol_dir)).hf_config
    other.no_rope_layers = uses_rope
    diff = _max_diff(_chunked(replace(loaded, hf_config=other), ids), _reference(smol_dir, ids))
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
    ids = _ids(36, seed=6)
    ours = _chunked(load_model(str(smol_dir)), ids, "bfloat16")
    gold = _reference(smol_dir, ids)
    ours_err, theirs_err = (
        (x - gold).abs().max().item() for x in (ours, _reference_bf16(smol_dir, ids))
    )
    assert ours_err <= 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)


@cache
def _hf_outputs(model_dir: Path) -> list[list[int]]:
    return [hf_greedy(model_dir, p, MAX_TOKENS) for p in _prompts()]


def _prompts() -> list[list[int]]:
    repeats = [p * 3 for p in random_prompts(2, (4, 8), 300, seed=9)]  # n-gram matches
    return random_prompts(4, (3, 30), 300, seed=7) + repeats


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, smol_dir: Path, draft_dir: Path) -> None:
    """Six requests batched, prompts in chunks of at most 9 tokens, with and without speculation."""
    spec = {
        "none": SpeculativeConfig(),
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
        "draft": SpeculativeConfig(
            method="draft", num_speculative_tokens=3, draft_model=str(draft_dir), adaptive=False
        ),
    }[kind]
    engine = make_engine(smol_dir, speculative=spec, max_num_batched_tokens=9)
    assert outputs(engine, _prompts(), greedy(MAX_TOKENS)) == _hf_outputs(smol_dir)
