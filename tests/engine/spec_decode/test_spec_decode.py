"""Speculative decoding is lossless: greedy output equals plain greedy; sampling keeps the distribution."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_utils import (
    chi_square_pvalue,
    greedy,
    hf_model,
    make_engine,
    outputs,
    random_prompts,
)

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams

MAX_TOKENS = 12


def _spec_engine(kind: str, model: Path, draft: Path, k: int = 4, vocab: int = 0) -> LLMEngine:
    if kind == "ngram":
        spec = SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, ngram_min=1, ngram_max=3, adaptive=False
        )
    else:
        spec = SpeculativeConfig(
            method="draft",
            num_speculative_tokens=k,
            adaptive=False,
            draft_model=str(draft if kind == "draft" else model),
            # self-draft-head: the target drafts for itself from the first half of the ids only
            draft_vocab_size=vocab // 2 if kind == "self-draft-head" else None,
        )
    return make_engine(model, speculative=spec)


def _repetitive_prompts(n: int, vocab: int) -> list[list[int]]:
    """Prompts with repeats, so n-gram lookup finds matches (and some misses)."""
    base = random_prompts(n, (4, 12), vocab, seed=31)
    return [p * 3 + p[:2] for p in base]


@pytest.mark.parametrize("kind", ["draft", "self-draft", "self-draft-head", "ngram"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_speculation_equals_plain(
    kind: str, batch: int, plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    engine = _spec_engine(kind, tiny_model_dir, tiny_draft_dir, vocab=vocab)
    prompts = (
        _repetitive_prompts(batch, vocab)
        if kind == "ngram"
        else random_prompts(batch, (3, 30), vocab, 41)
    )
    ks = [None, 0, 1, 2, 3, 4, 2, None][:batch]  # mixed k per request, including 0 (plain)
    params = [greedy(MAX_TOKENS, num_speculative_tokens=k) for k in ks]
    spec_seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in spec_seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    drafted = sum(s.spec.num_draft_tokens for s in spec_seqs)
    accepted = sum(s.spec.num_accepted_tokens for s in spec_seqs)
    assert drafted > 0
    if kind == "self-draft":
        assert accepted == drafted  # the target drafting for itself is always right
    if kind == "self-draft-head" and batch > 1:
        # right wherever the target's pick lies in the head's half, and only there
        assert 0 < accepted < drafted
        limit = vocab // 2
        for seq in spec_seqs:
            assert seq.spec.num_accepted_tokens <= sum(t < limit for t in seq.output_token_ids)
    for seq, k in zip(spec_seqs, ks, strict=True):
        if k == 0:
            assert seq.spec.num_draft_tokens == 0
    assert engine.block_manager.usage == 0.0


@pytest.mark.parametrize("kind", ["self-draft", "ngram"])
def test_stops_inside_accepted_runs(
    kind: str, plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    engine = _spec_engine(kind, tiny_model_dir, tiny_draft_dir, k=4)
    prompts = _repetitive_prompts(4, vocab)
    refs = outputs(plain, prompts, greedy(MAX_TOKENS))
    for prompt, ref in zip(prompts, refs, strict=True):
        stop_token = ref[6]
        cut = ref.index(stop_token) + 1
        seq = engine.generate([prompt], greedy(MAX_TOKENS, stop_token_ids=(stop_token,)))[0]
        assert seq.output_token_ids == ref[:cut] and seq.finish_reason == "stop"
        seq = engine.generate([prompt], greedy(5))[0]  # max_tokens inside a run
        assert seq.output_token_ids == ref[:5] and seq.finish_reason == "length"
    assert engine.block_manager.usage == 0.0


def test_greedy_speculation_with_chunked_prefill_and_preemption(
    tiny_model_dir: Path, tiny_draft_dir: Path, plain: LLMEngine, vocab: int
) -> None:
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=3, draft_model=str(tiny_draft_dir), adaptive=False
    )
    engine = make_engine(
        tiny_model_dir, speculative=spec, num_kv_blocks=24, max_num_batched_tokens=9
    )
    prompts = random_prompts(4, (15, 30), vocab, seed=43)
    assert outputs(engine, prompts, greedy(MAX_TOKENS)) == outputs(
        plain, prompts, greedy(MAX_TOKENS)
    )
    assert engine.block_manager.num_free_blocks == 24


# ---- sampling: the first two tokens keep the target's distribution ------------------------------

TEMPERATURE = 1.5
NUM_SAMPLES = 2000


def _exact_pair_probs(model_dir: Path, prompt: list[int]) -> np.ndarray:
    """P(t1, t2) under the target at TEMPERATURE, computed exactly from transformers' logits."""
    model = hf_model(model_dir)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / TEMPERATURE, -1)
        vocab = first.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.softmax(model(batch).logits[:, -1] / TEMPERATURE, -1)
    return (first[:, None] * second).double().numpy()  # [vocab, vocab]


def _sample_pairs(engine: LLMEngine, prompt: list[int]) -> tuple[list[tuple[int, int]], int]:
    """NUM_SAMPLES two-token samples, and how many draft tokens were verified on the way."""
    params = [
        SamplingParams(max_tokens=2, temperature=TEMPERATURE, seed=s, ignore_eos=True)
        for s in range(NUM_SAMPLES)
    ]
    seqs = engine.generate([prompt] * NUM_SAMPLES, params)
    pairs = [(s.output_token_ids[0], s.output_token_ids[1]) for s in seqs]
    return pairs, sum(s.spec.num_draft_tokens for s in seqs)


@pytest.mark.parametrize("kind", ["none", "draft", "draft-head", "ngram", "hybrid"])
def test_sampled_pairs_follow_target_distribution(
    kind: str, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    prompt = random_prompts(1, (6, 6), vocab, seed=47)[0]
    prompt = prompt + prompt  # gives the n-gram proposer something to match
    spec = {
        "none": SpeculativeConfig(),
        "draft": SpeculativeConfig(
            method="draft",
            num_speculative_tokens=2,
            draft_model=str(tiny_draft_dir),
            adaptive=False,
        ),
        # the draft proposes from the first half of the ids only (its q is 0 on the rest)
        "draft-head": SpeculativeConfig(
            method="draft",
            num_speculative_tokens=2,
            draft_model=str(tiny_draft_dir),
            adaptive=False,
            draft_vocab_size=vocab // 2,
        ),
        "ngram": SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, ngram_min=1, ngram_max=3, adaptive=False
        ),
        # n-gram matches where the prompt repeats, the draft model elsewhere (max_tokens 2: the
        # second token's lookup may or may not match, so both proposers get sampled rows).
        "hybrid": SpeculativeConfig(
            method="hybrid",
            num_speculative_tokens=2,
            draft_model=str(tiny_draft_dir),
            ngram_min=2,
            ngram_max=3,
            adaptive=False,
        ),
    }[kind]
    engine = make_engine(
        tiny_model_dir,
        speculative=spec,
        num_kv_blocks=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    pairs, drafted = _sample_pairs(engine, prompt)
    assert (drafted > 0) == (kind != "none")
    assert len(set(pairs)) > 10  # not vacuous: sampling really spreads over many pairs
    assert chi_square_pvalue(pairs, _exact_pair_probs(tiny_model_dir, prompt)) > 1e-3


@pytest.mark.parametrize("p_min", [0.0, 0.3])
def test_adaptive_k_and_confidence_cutoff_stay_lossless(
    p_min: float, plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    spec = SpeculativeConfig(
        method="draft",
        num_speculative_tokens=4,
        draft_model=str(tiny_draft_dir),
        adaptive=True,
        draft_p_min=p_min,
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    prompts = random_prompts(6, (3, 30), vocab, seed=53)
    assert outputs(engine, prompts, greedy(20)) == outputs(plain, prompts, greedy(20))
    assert engine.costs.target.known and engine.costs.draft.known  # it measured both models


def test_seeded_sampling_reproduces_under_adaptive_speculation(
    tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=3, draft_model=str(tiny_draft_dir), adaptive=True
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    prompts = random_prompts(5, (4, 20), vocab, seed=59)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=77, ignore_eos=True)
    others = [SamplingParams(max_tokens=16, temperature=0.7, ignore_eos=True)] * 4
    alone = outputs(engine, prompts[:1], seeded)[0]
    mixed = outputs(engine, prompts, [seeded, *others])[0]
    assert alone == mixed == outputs(engine, prompts[:1], seeded)[0]
