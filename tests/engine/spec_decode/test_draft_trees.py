"""EAGLE-2 dynamic trees from the draft model: one draft forward per level over the draft's own
paged pool, the target verifies the tree in one forward, and nothing changes the output; the
draft's K/V below its frontier is always its own request's tokens'."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jsonschema
import pytest
import torch
from engine_utils import chi_square_pvalue, greedy, hf_model, make_engine, outputs, random_prompts
from safetensors.torch import load_file, save_file
from test_eagle3 import CYCLE, _cycle_basis, bigram_target
from test_spec_decode import TEMPERATURE, _exact_pair_probs
from test_trees import SCHEMA

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model.runner import ForwardInput, ModelRunner
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import Constraints, grammar_from
from engine.sequence import Sequence
from engine.spec_decode.proposers import Proposal
from engine.spec_decode.proposers.tree import ROOT

MAX_TOKENS = 12
__all__ = ["bigram_target"]  # the fixture, shared with test_eagle3


def _engine(
    target: Path, draft: Path, k: int = 5, width: int = 3, **overrides: object
) -> LLMEngine:
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=k, draft_model=str(draft), adaptive=False,
        tree_width=width,
    )  # fmt: skip
    return make_engine(target, speculative=spec, **overrides)


class _Spy:
    """The tree proposals an engine makes and how often an accepted path left the first path."""

    def __init__(self, engine: LLMEngine) -> None:
        self.trees: list[Proposal] = []
        self.proposals: list[Proposal] = []  # every non-empty one, trees and chains
        self.moved = 0
        propose, move = engine.proposer.propose, engine.target.move_kv

        def spy_propose(batch: list) -> list[Proposal]:  # type: ignore[type-arg]
            proposals = propose(batch)
            self.trees += [p for p in proposals if p.parents is not None]
            self.proposals += [p for p in proposals if p.token_ids]
            return proposals

        def spy_move(table: list[int], moves: list[tuple[int, int]]) -> None:
            self.moved += bool(moves)
            move(table, moves)

        engine.proposer.propose = spy_propose  # type: ignore[method-assign]
        engine.target.move_kv = spy_move  # type: ignore[method-assign]


@pytest.mark.parametrize(("batch", "width"), [(1, 3), (6, 2), (6, 3)])
def test_greedy_draft_trees_equal_plain(
    batch: int, width: int, plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    engine = _engine(tiny_model_dir, tiny_draft_dir, width=width)
    spy = _Spy(engine)
    prompts = random_prompts(batch, (3, 30), vocab, seed=83)
    ks = [None, 0, 2, 5, 3, None][:batch]  # per request, including 0 (plain)
    seqs = engine.generate(prompts, [greedy(MAX_TOKENS, num_speculative_tokens=k) for k in ks])
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert spy.trees and all(len(p.token_ids) <= 5 for p in spy.trees)
    assert all(len(p.tree.children(ROOT)) <= width for p in spy.trees if p.tree)
    assert sum(s.spec.num_accepted_tokens for s in seqs) > 0
    assert engine.block_manager.usage == 0.0


def _first_path(proposal: Proposal) -> int:
    """The length of a proposal's leading chain (all of a chain)."""
    tree = proposal.tree
    return len(proposal.token_ids) if tree is None else len(tree.path(tree.leaves[0]))


def _draft_kv_is_own(engine: LLMEngine, seq: Sequence) -> bool:
    """The draft's K/V of positions [0, its frontier) equals a fresh prefill of the request's
    own tokens, every layer (on scratch blocks taken from the pool and given back)."""
    draft, blocks = engine.draft, engine.block_manager
    assert isinstance(draft, ModelRunner)
    n = seq.num_draft_computed_tokens
    if n == 0:
        return True
    scratch: list[int] = []
    assert blocks.grow(scratch, n)
    try:
        draft.forward([ForwardInput(seq.token_ids[:n], 0, scratch, 1)])
        held, fresh = (draft._slots(table, list(range(n))) for table in (seq.block_table, scratch))
        return all(
            torch.allclose(cache[:, held], cache[:, fresh], atol=1e-4, rtol=1e-3)
            for pair in draft.kv_caches
            for cache in (c.view(c.shape[0], -1, c.shape[-1]) for c in pair)
        )
    finally:
        blocks.release(scratch)


def test_staggered_arrivals_prefix_cache_and_the_drafts_own_kv(
    plain: LLMEngine, tiny_model_dir: Path, vocab: int
) -> None:
    """The target drafting for itself (two layers: its K/V depends on the context it saw), its
    requests joining a running batch step by step, then the same prompts again from the prefix
    cache. Every tree's first path is the target's own greedy text, so each step accepts all of
    it (the levels' forwards rotate and mask each node as its path would be); after every step
    the draft's K/V below each request's frontier is that request's own, the frontier having
    moved past the catch-up along the accepted first path."""
    engine = _engine(tiny_model_dir, tiny_model_dir, k=4, width=3, num_kv_blocks=128)
    spy = _Spy(engine)
    prompts = random_prompts(6, (8, 40), vocab, seed=89)
    seqs = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
        seqs.append(engine.seqs[f"r{i}"])
        engine.step()
        assert all(_draft_kv_is_own(engine, s) for s in engine.scheduler.running)
    ahead = 0  # steps whose draft frontier was left past the catch-up
    while engine.has_unfinished():
        before = {s: s.num_tokens for s in engine.scheduler.running}
        engine.step()
        assert all(_draft_kv_is_own(engine, s) for s in engine.scheduler.running)
        ahead += sum(s.num_draft_computed_tokens > n for s, n in before.items())
    reference = outputs(plain, prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == reference
    assert sum(s.spec.num_accepted_tokens for s in seqs) == sum(map(_first_path, spy.proposals))
    again = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in again] == reference
    assert all(s.num_cached_tokens > 0 for s in again)
    assert spy.trees and ahead > 0


@pytest.fixture(scope="module")
def skipping_draft(bigram_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bigram target with a head that prefers the token after next: for CYCLE[i] its top
    pick is CYCLE[i + 2] (q ~ 0.38), the target's CYCLE[i + 1] its second (q ~ 0.23)."""
    path = tmp_path_factory.mktemp("skipping")
    shutil.copytree(bigram_target, path, dirs_exist_ok=True)
    file = path / "model.safetensors"
    weights = load_file(str(file))
    basis, n = _cycle_basis(), len(CYCLE)
    head = weights["lm_head.weight"].zero_()
    for i in range(n):  # logits 5.5 and 6: the final norm scales a unit vector of 64 by 8
        head[CYCLE[(i + 1) % n]] += 5.5 / 8 * basis[i]
        head[CYCLE[(i + 2) % n]] += 6.0 / 8 * basis[i]
    save_file(weights, str(file))
    return path


def test_an_accepted_second_branch_cuts_the_drafts_frontier(
    bigram_target: Path, skipping_draft: Path
) -> None:
    """Every tree's first path (the draft's top picks) is rejected and a later branch accepted:
    the draft holds the first path's K/V in place, which must not count as the accepted
    tokens'. After every step the draft's K/V below the frontier is the request's own."""
    vocab = int(hf_model(bigram_target).config.vocab_size)
    engine = _engine(bigram_target, skipping_draft, k=4, width=2)
    spy = _Spy(engine)
    prompts = random_prompts(4, (3, 20), vocab, seed=103)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    seqs = [engine.seqs[f"r{i}"] for i in range(len(prompts))]
    while engine.has_unfinished():
        engine.step()
        assert all(_draft_kv_is_own(engine, s) for s in engine.scheduler.running)
    reference = outputs(make_engine(bigram_target), prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == reference
    assert spy.moved >= len(prompts) and all(s.spec.num_accepted_tokens > 0 for s in seqs)


def test_seeded_draft_trees_equal_plain_and_chains(
    plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    prompts = random_prompts(4, (3, 20), vocab, seed=97)
    seeded = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    engine = _engine(tiny_model_dir, tiny_draft_dir)
    spy = _Spy(engine)
    chains = _engine(tiny_model_dir, tiny_draft_dir, width=1)
    reference = outputs(plain, prompts, seeded)
    assert outputs(engine, prompts, seeded) == reference == outputs(chains, prompts, seeded)
    assert spy.trees


def test_unseeded_pairs_through_draft_trees_follow_the_target(
    tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    """Unseeded sampling: the tree sampler's multi-step rejection over the draft's top-2
    siblings; the first two tokens against the target's exact joint distribution."""
    prompt = random_prompts(1, (6, 6), vocab, seed=42)[0] * 2  # its first tree: two siblings
    engine = _engine(
        tiny_model_dir, tiny_draft_dir, k=2, width=2,
        num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=8192,
    )  # fmt: skip
    spy = _Spy(engine)
    # max_tokens 3: the first step may draft 2 (the last token is always the target's own)
    params = SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True)
    seqs = engine.generate([prompt] * 2000, params)
    pairs = [(s.output_token_ids[0], s.output_token_ids[1]) for s in seqs]
    assert any(p.tree and len(p.tree.children(ROOT)) == 2 for p in spy.trees)  # siblings tried
    assert len(set(pairs)) > 10
    assert chi_square_pvalue(pairs, _exact_pair_probs(tiny_model_dir, prompt)) > 1e-3


def test_json_schema_under_draft_trees(
    plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    """Each node's row masked after its own path: output equal to plain decoding's and valid."""
    engine = _engine(tiny_model_dir, tiny_draft_dir, k=5, width=3)
    spy = _Spy(engine)
    params = SamplingParams(
        max_tokens=120,
        temperature=0.0,
        constraints=Constraints(grammar=grammar_from("json", SCHEMA)),
    )
    prompts = random_prompts(3, (3, 20), vocab, seed=101)
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, params)
    assert all(s.finish_reason == "stop" for s in seqs) and spy.trees
    for seq in seqs:
        jsonschema.validate(json.loads(engine.tokenizer.decode(seq.output_token_ids)), SCHEMA)


def test_the_planner_prices_the_drafts_tree_width(
    tiny_model_dir: Path, tiny_draft_dir: Path
) -> None:
    """An adaptive engine's planner runs `width` draft rows a request per tree level (chains: 1)."""
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=4, draft_model=str(tiny_draft_dir), tree_width=3
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    assert engine.planner is not None and engine.planner.tree_width == 3
    chains = make_engine(tiny_model_dir, speculative=dataclasses.replace(spec, tree_width=1))
    assert chains.planner is not None and chains.planner.tree_width == 1
