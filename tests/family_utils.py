"""What the model-family tests share (tests/engine/model/test_granite.py, test_smollm3.py,
test_phi3.py): the runner's logits through prompt chunks, a verify query and single decodes;
transformers' logits as the reference; and greedy output against transformers' own generate,
batched, in small chunks, with and without speculation."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from engine_utils import greedy, hf_greedy, hf_model, make_engine, outputs, random_prompts
from transformers import AutoModelForCausalLM

from engine.config import SpeculativeConfig
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ForwardInput, ModelRunner

MAX_TOKENS = 12


def prompt_ids(n: int, seed: int) -> list[int]:
    return random_prompts(1, (n, n), 300, seed)[0]


def runner_logits(
    loaded: LoadedModel, ids: list[int], dtype: str = "float32"
) -> torch.Tensor:  # [len(ids), vocab_size]
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


def file_logits(
    path: Path, quantization: str, ids: list[int]
) -> tuple[ModelRunner, torch.Tensor]:  # the runner, [len(ids), vocab_size]
    """A model file's logits: a prompt chunk (past a window, for long `ids`), then a 3-token
    verify query and a decode, through shuffled blocks."""
    runner = ModelRunner(load_model(str(path), quantization), "cpu", "float32", 4)  # type: ignore[arg-type]
    runner.allocate_kv_cache(32)
    table = list(range(31, -1, -1))
    cuts = [0, len(ids) - 4, len(ids) - 1, len(ids)]
    outs = [
        runner.forward([ForwardInput(ids[a:b], a, table, b - a)])
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    return runner, torch.cat(outs)


@torch.no_grad()
def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab_size]
    return hf_model(model_dir)(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_logits_bf16(model_dir: Path, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab_size]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    return model(torch.tensor([ids])).logits[0].float()


def max_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape
    return (ours - ref).abs().max().item()


def assert_logits_match_transformers(model_dir: Path, atol: float = 1e-4) -> None:
    """Three prompts through prompt chunks, a verify query and decodes (`runner_logits`), each
    within `atol` of transformers' float32 logits."""
    loaded = load_model(str(model_dir))
    for seed, n in ((1, 40), (2, 13), (3, 33)):
        ids = prompt_ids(n, seed)
        diff = max_diff(runner_logits(loaded, ids), hf_logits(model_dir, ids))
        assert diff < atol, f"max abs diff {diff}"


def assert_bf16_as_accurate_as_transformers(model_dir: Path) -> None:
    """In bfloat16 our error against transformers' float32 logits is no worse than transformers'
    own bfloat16 error: each constant rounds where transformers rounds it."""
    ids = prompt_ids(36, seed=6)
    gold = hf_logits(model_dir, ids)
    ours = max_diff(runner_logits(load_model(str(model_dir)), ids, "bfloat16"), gold)
    theirs = max_diff(hf_logits_bf16(model_dir, ids), gold)
    assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)


def batched_prompts() -> list[list[int]]:
    repeats = [p * 3 for p in random_prompts(2, (4, 8), 300, seed=9)]  # n-gram matches
    return random_prompts(4, (3, 30), 300, seed=7) + repeats


@cache
def hf_outputs(model_dir: Path) -> list[list[int]]:
    return [hf_greedy(model_dir, p, MAX_TOKENS) for p in batched_prompts()]


def assert_greedy_equals_transformers(
    kind: str, model_dir: Path, draft_dir: Path, reference: Path | None = None, **engine: object
) -> None:
    """Six requests batched, prompts in chunks of at most 9 tokens; `kind`: none, ngram, draft.
    `reference`: transformers' model to match when `model_dir` is not one (a GGUF file);
    `engine`: EngineConfig fields (quantization)."""
    spec = {
        "none": SpeculativeConfig(),
        "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
        "draft": SpeculativeConfig(
            method="draft", num_speculative_tokens=3, draft_model=str(draft_dir), adaptive=False
        ),
    }[kind]
    llm = make_engine(model_dir, speculative=spec, max_num_batched_tokens=9, **engine)
    assert outputs(llm, batched_prompts(), greedy(MAX_TOKENS)) == hf_outputs(reference or model_dir)
