"""Helpers for engine tests: build engines on tiny models, references from transformers."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams

_HF_CACHE: dict[str, torch.nn.Module] = {}


def make_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    spec = overrides.pop("speculative", SpeculativeConfig())
    fields: dict[str, object] = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=512,
        max_num_seqs=32,
        max_num_batched_tokens=256,
        speculative=spec,
    )
    fields.update(overrides)
    return LLMEngine(EngineConfig(**fields))  # type: ignore[arg-type]


def hf_model(model_dir: Path) -> torch.nn.Module:
    key = str(model_dir)
    if key not in _HF_CACHE:
        model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
        _HF_CACHE[key] = model.eval()
    return _HF_CACHE[key]


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, EOS ignored (we compare fixed-length runs)."""
    model = hf_model(model_dir)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def outputs(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    return [seq.output_token_ids for seq in engine.generate(prompts, params)]


def chi_square_pvalue(
    pairs: list[tuple[int, int]], probs: np.ndarray, max_cells: int = 200
) -> float:
    """Chi-square p-value of sampled token pairs against their exact joint probs [vocab, vocab]:
    the likeliest cells with enough expected mass, the rest pooled into one."""
    flat = probs.ravel()
    cells = [c for c in np.argsort(flat)[::-1] if flat[c] * len(pairs) >= 5][:max_cells]
    index = {c: i for i, c in enumerate(cells)}
    observed = np.zeros(len(cells) + 1)
    vocab = probs.shape[1]
    for t1, t2 in pairs:
        observed[index.get(t1 * vocab + t2, len(cells))] += 1
    expected = np.append(flat[cells], 1 - flat[cells].sum()) * len(pairs)
    return float(stats.chisquare(observed, expected).pvalue)
