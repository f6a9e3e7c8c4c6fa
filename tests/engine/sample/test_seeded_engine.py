"""A seed fixes the text: speculation off or on (any proposer, any k), alone or in a batch,
cold or warm prefix cache, across preemption (tiny float32 models, temperature 0.8, top-p 0.9)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_utils import make_engine, outputs, random_prompts

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(vocab: int) -> list[list[int]]:
    """Two prompts that repeat themselves, so the n-gram proposer finds matches."""
    return [p + p for p in random_prompts(2, (6, 10), vocab, seed=83)]


def seeded(seed: int = 3, choice: int = 0, **kw: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.8,
        top_p=0.9,
        seed=seed,
        choice=choice,
        ignore_eos=True,
        **kw,  # type: ignore[arg-type]
    )


def _engine(method: str, k: int, draft: Path | None, **overrides: object) -> LLMEngine:
    spec = SpeculativeConfig(
        method=method,
        num_speculative_tokens=k,
        draft_model=None if draft is None else str(draft),
        adaptive=False,
    )
    return make_engine(overrides.pop("target"), speculative=spec, **overrides)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The reference: speculation off, each (prompt, choice) alone."""
    engine = make_engine(tiny_model_dir)
    return [outputs(engine, [p], seeded(choice=c))[0] for p in prompts for c in (0, 1)]


CASES = [("draft", k) for k in (1, 2, 3, 4, 5)] + [("ngram", 3), ("hybrid", 4)]


@pytest.mark.parametrize(("method", "k"), CASES, ids=[f"{m}-k{k}" for m, k in CASES])
def test_speculation_never_changes_the_seeded_text(
    method: str,
    k: int,
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    prompts: list[list[int]],
    plain: list[list[int]],
) -> None:
    draft = None if method == "ngram" else tiny_draft_dir
    engine = _engine(method, k, draft, target=tiny_model_dir)
    params = [seeded(choice=c) for _ in prompts for c in (0, 1)]
    seqs = engine.generate([p for p in prompts for _ in (0, 1)], params)
    assert [s.output_token_ids for s in seqs] == plain
    assert sum(s.spec.num_draft_tokens for s in seqs) > 0  # it did speculate
    assert plain[0] != plain[1]  # each choice has its own stream


def test_a_self_draft_accepts_every_seeded_token(
    tiny_model_dir: Path, prompts: list[list[int]], plain: list[list[int]]
) -> None:
    """Draft = target and the draft samples with the target's noise: every draft is the target's
    token, so sample-and-match accepts all of them (rejection sampling would not)."""
    engine = _engine("draft", 3, tiny_model_dir, target=tiny_model_dir)
    seq = engine.generate([prompts[0]], seeded())[0]
    assert seq.output_token_ids == plain[0]
    assert seq.spec.num_draft_tokens > 0 and seq.spec.acceptance_rate == 1.0


def test_batch_of_eight_others_and_a_warm_prefix_cache(
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    prompts: list[list[int]],
    plain: list[list[int]],
    vocab: int,
) -> None:
    """The issue's scenario: the same n = 2 request four times with draft speculation and prefix
    caching (cold, then warm: the draft catches up differently), then inside a batch of 8 others."""
    engine = _engine("draft", 3, tiny_draft_dir, target=tiny_model_dir)
    runs = [
        outputs(engine, [prompts[0]] * 2, [seeded(choice=0), seeded(choice=1)]) for _ in range(4)
    ]
    assert all(run == plain[:2] for run in runs)
    assert engine.block_manager.match_prefix(prompts[0])  # the prompt was cached
    others = random_prompts(8, (4, 30), vocab, seed=89)
    other_params = [
        SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0.8 + 0.1 * (i % 3), seed=None, ignore_eos=True
        )
        if i % 2
        else seeded(seed=100 + i, top_k=5)
        for i in range(8)
    ]
    mixed = outputs(
        engine,
        [*others[:4], prompts[0], *others[4:]],
        [*other_params[:4], seeded(), *other_params[4:]],
    )
    assert mixed[4] == plain[0]


def test_preemption_keeps_the_seeded_text(
    tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    many = random_prompts(4, (20, 30), vocab, seed=97)
    params = [seeded(seed=s) for s in range(4)]
    roomy = outputs(make_engine(tiny_model_dir), many, params)
    engine = _engine("draft", 3, tiny_draft_dir, target=tiny_model_dir, num_kv_blocks=24)
    for i, (prompt, p) in enumerate(zip(many, params, strict=True)):
        engine.add_request(f"p{i}", prompt, p)
    seqs = [engine.seqs[f"p{i}"] for i in range(4)]
    preemptions = 0
    while engine.has_unfinished():
        engine.step()
        preemptions += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert preemptions > 0
    assert [s.output_token_ids for s in seqs] == roomy


def test_acceptance_bench_counts_drafts(tiny_model_dir: Path, prompts: list[list[int]]) -> None:
    """bench.seeded_acceptance on a self-draft: both kinds accept every draft (q = p), and the
    counts add up over prompts and seeds."""
    from bench.seeded_acceptance import compare

    engine = _engine("draft", 3, tiny_model_dir, target=tiny_model_dir)
    comparison = compare(engine, prompts, 0.8, 8, seeds=[0, 1])
    assert comparison.same_text == comparison.answers == 2 * len(prompts)
    for run in (comparison.unseeded, comparison.seeded):
        assert run.drafted > 0 and run.rate == 1.0
        assert 0 < run.emitted <= 2 * len(prompts) * 8
