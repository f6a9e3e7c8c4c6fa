"""EAGLE-2 dynamic trees from an EAGLE-3 head: the head expands the likeliest nodes level by
level, the target verifies the tree in one forward, and nothing changes the output."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_utils import greedy, hf_model, make_engine, outputs, random_prompts
from test_eagle3 import CYCLE, _copy_head, bigram_target, write_head

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams
from engine.spec_decode.proposers import Proposal
from engine.spec_decode.proposers.tree import ROOT

MAX_TOKENS = 12
__all__ = ["bigram_target"]  # the fixture, shared with test_eagle3


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, vocab: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    draft_ids = sorted({*range(0, vocab, 2), 0})
    return write_head(tmp_path_factory.mktemp("eagle3_tree"), tiny_model_dir, draft_ids)


def _engine(target: Path, head: Path, k: int = 5, width: int = 3) -> LLMEngine:
    spec = SpeculativeConfig(
        method="eagle3", num_speculative_tokens=k, draft_model=str(head), adaptive=False,
        tree_width=width,
    )  # fmt: skip
    return make_engine(target, speculative=spec)


def _record_trees(engine: LLMEngine) -> list[Proposal]:
    seen: list[Proposal] = []
    propose = engine.proposer.propose

    def spy(batch: list) -> list[Proposal]:  # type: ignore[type-arg]
        proposals = propose(batch)
        seen.extend(p for p in proposals if p.parents is not None)
        return proposals

    engine.proposer.propose = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_trees_equal_plain(
    batch: int, plain: LLMEngine, tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    engine = _engine(tiny_model_dir, head_dir)
    trees = _record_trees(engine)
    prompts = random_prompts(batch, (1, 30), vocab, seed=61)
    ks = [None, 0, 2, 5, 3, None][:batch]
    seqs = engine.generate(prompts, [greedy(MAX_TOKENS, num_speculative_tokens=k) for k in ks])
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert trees and all(len(p.token_ids) <= 5 for p in trees)
    assert engine.block_manager.usage == 0.0


def test_a_copying_heads_best_child_is_accepted_every_step(
    bigram_target: Path, tmp_path: Path
) -> None:
    """The copying head's top token at the root is always the target's next token: with trees
    its first child is accepted in every drafting step, so the tree's root row comes from the
    head at the right position, and the children are its likeliest tokens, best first."""
    vocab = hf_model(bigram_target).config.vocab_size
    draft_ids = sorted({*CYCLE, *range(0, vocab, 7)})
    head = write_head(tmp_path / "head", bigram_target, draft_ids, edit=_copy_head)
    engine = _engine(bigram_target, head, k=4, width=2)
    trees = _record_trees(engine)
    prompts = random_prompts(4, (3, 20), vocab, seed=71)
    seqs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == outputs(
        make_engine(bigram_target), prompts, greedy(MAX_TOKENS)
    )
    assert trees and all(len(p.tree.children(ROOT)) == 2 for p in trees if p.tree)
    for seq in seqs:
        assert seq.spec.num_drafts >= 4
        assert seq.spec.accepted_per_pos[0] == seq.spec.num_drafts


def test_seeded_and_sampled_trees_stay_lossless(
    plain: LLMEngine, tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    engine = _engine(tiny_model_dir, head_dir)
    trees = _record_trees(engine)
    prompts = random_prompts(4, (3, 20), vocab, seed=67)
    seeded = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    assert outputs(engine, prompts, seeded) == outputs(plain, prompts, seeded)
    unseeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, ignore_eos=True)
    assert all(len(s.output_token_ids) == MAX_TOKENS for s in engine.generate(prompts, unseeded))
    assert trees
