"""Mistral's window on every layer and Qwen2's on the layers from max_window_layers on are real
windows (the context is not clipped to them): greedy continuations and logits past the window
are transformers' own, batched, with chunked prefill and prefix caching."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_greedy, make_engine, outputs, random_prompts
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM

from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

WINDOW = 8
MAX_TOKENS = 12
CONFIGS: dict[str, dict[str, object]] = {
    "mistral": {"sliding_window": WINDOW},
    # layer 0 full, layers 1 and 2 windowed (transformers' layer_types)
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = str(request.param)
    path = tmp_path_factory.mktemp(f"{family}_window")
    return make_tiny_model(path, family=family, seed=3, num_layers=3, **CONFIGS[family])


def test_windowed_layers_are_kept_and_the_context_not_clipped(model_dir: Path) -> None:
    engine = make_engine(model_dir)
    shape = engine.target.model.shape
    want = [
        "full_attention" if "qwen2" in model_dir.name and i < 1 else "sliding_attention"
        for i in range(3)
    ]
    assert shape.sliding_window == WINDOW and list(shape.layer_types) == want
    assert engine.max_model_len == 512  # max_position_embeddings, not the window


@torch.no_grad()
def _logits(model_dir: Path, ids: list[int], **config: object) -> torch.Tensor:  # [len, vocab]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **config)
    return model(torch.tensor([ids])).logits[0]


def test_logits_past_the_window_are_transformers(model_dir: Path) -> None:
    """A prompt chunk of 30, then chunks of 5 and single decodes: every position's logits."""
    ids = random_prompts(1, (45, 45), 300, seed=5)[0]
    runner = ModelRunner(load_model(str(model_dir)), "cpu", "float32", 4)
    runner.allocate_kv_cache(32)
    table, outs, pos = list(range(31, 15, -1)), [], 0
    for size in (30, 5, 1, 1, 5, 3):
        chunk = ids[pos : pos + size]
        outs.append(runner.forward([ForwardInput(chunk, pos, table, len(chunk))]))
        pos += size
    ours, ref = torch.cat(outs), _logits(model_dir, ids)
    assert (ours - ref).abs().max().item() < 1e-4
    # the window decides these logits: without it transformers gives other ones past it
    full = _logits(model_dir, ids, sliding_window=1000)
    assert (ref[WINDOW + 1 :] - full[WINDOW + 1 :]).abs().max() > 1e-2


def test_greedy_equals_transformers_batched_chunked_and_prefix_cached(model_dir: Path) -> None:
    """Prompts longer than the window, two sharing a 20-token prefix, prefills in chunks of 7;
    then the same prompts again, their prefixes cached."""
    prompts = random_prompts(3, (12, 40), 300, seed=7)
    shared = random_prompts(1, (20, 20), 300, seed=8)[0]
    prompts += [shared + p for p in random_prompts(2, (3, 9), 300, seed=9)]
    want = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(model_dir, max_num_batched_tokens=7)
    assert outputs(engine, prompts, greedy(MAX_TOKENS)) == want
    assert outputs(engine, prompts[::-1], greedy(MAX_TOKENS)) == want[::-1]
    assert engine.block_manager.num_hit_tokens > 0
