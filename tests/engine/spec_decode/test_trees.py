"""Draft trees: one verify forward over a tree (tree mask, depth positions), the longest accepted
path kept (its K/V moved into position order), lossless greedy, seeded and sampled."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
from engine_utils import greedy, make_engine, outputs
from scipy import stats

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model.attention import AttentionMetadata, RequestSpan, paged_attention
from engine.model.runner import ForwardInput
from engine.outputs import SpecStats
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import Constraints, grammar_from
from engine.spec_decode.proposers import Proposal
from engine.spec_decode.proposers.tree import ROOT, DraftTree, tree_from_paths
from engine.spec_decode.tree_sampler import verify_tree

MAX_TOKENS = 16
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


def _tree_engine(model: Path, width: int = 3, k: int = 6, **overrides: object) -> LLMEngine:
    spec = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=k,
        ngram_min=1,
        ngram_max=3,
        adaptive=False,
        tree_width=width,
    )
    return make_engine(model, speculative=spec, **overrides)


def _ambiguous_prompts(n: int, vocab: int, seed: int = 5) -> list[list[int]]:
    """Text over a few tokens, so each n-gram recurs with different continuations."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        alphabet = rng.sample(range(3, vocab), 4)
        prompts.append([rng.choice(alphabet) for _ in range(rng.randint(20, 40))])
    return prompts


class _Spy:
    """Counts the tree proposals an engine makes and the K/V moves its accepted paths need."""

    def __init__(self, engine: LLMEngine) -> None:
        self.trees = self.moved = 0
        propose, move = engine.proposer.propose, engine.target.move_kv

        def spy_propose(batch: list) -> list[Proposal]:  # type: ignore[type-arg]
            proposals = propose(batch)
            self.trees += sum(p.parents is not None for p in proposals)
            return proposals

        def spy_move(table: list[int], moves: list[tuple[int, int]]) -> None:
            self.moved += bool(moves)
            move(table, moves)

        engine.proposer.propose = spy_propose  # type: ignore[method-assign]
        engine.target.move_kv = spy_move  # type: ignore[method-assign]


# ---- the tree itself --------------------------------------------------------------------------


def test_tree_shape_and_paths() -> None:
    tree = DraftTree((5, 6, 7, 8, 9), (ROOT, 0, 1, 0, ROOT))
    assert tree.depths == (1, 2, 3, 2, 1) and tree.max_depth == 3
    assert tree.children(ROOT) == [0, 4] and tree.children(0) == [1, 3]
    assert tree.path(3) == [0, 3] and tree.path_tokens(2) == [5, 6, 7]
    assert tree.leaves == [2, 3, 4] and not tree.is_chain
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [0, 0, 0, 0, 1]]
    ).bool()
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.kv_moves([0, 1, 2]) == [] and tree.kv_moves([0, 3]) == [(3, 1)]
    assert tree.kv_moves([4]) == [(4, 0)]
    assert DraftTree.chain([1, 2, 3]).is_chain
    with pytest.raises(ValueError):
        DraftTree((1, 2), (ROOT, 1))  # a parent after its child


def test_tree_from_paths_keeps_the_first_path_in_place() -> None:
    tree = tree_from_paths([[1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9], [7, 8]], budget=8, branch_len=2)
    # branches take half the budget, 2 nodes each past where they leave; depth-first order puts
    # the first path at indices 0, 1, 2, 3
    assert tree.token_ids == (1, 2, 3, 4, 9, 9, 7, 8)
    assert tree.parents == (ROOT, 0, 1, 2, 1, 4, ROOT, 6)
    assert tree_from_paths([[1, 2, 3]], 8, 2).is_chain
    assert len(tree_from_paths([[1, 2, 3, 4], [5, 6, 7, 8]], 4, 3)) == 4  # the budget holds


# ---- attention over a tree against a dense masked reference ----------------------------------


def test_tree_attention_equals_dense_masked_reference() -> None:
    torch.manual_seed(0)
    heads, kv_heads, dim, block, context = 4, 2, 16, 4, 9
    tree = DraftTree((0, 0, 0, 0, 0, 0), (ROOT, 0, 0, ROOT, 3, 1))
    n = len(tree) + 1  # the last known token, then the nodes
    total = context + n
    cache = [torch.zeros(kv_heads, 8, block, dim) for _ in range(2)]
    table = [5, 2, 7, 0, 3]
    k_all, v_all = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    q = torch.randn(n, heads, dim)
    prefix = RequestSpan(0, context, table)
    meta = AttentionMetadata.build([prefix], block, torch.device("cpu"))
    paged_attention(torch.randn(context, heads, dim), k_all[:context], v_all[:context], *cache,
                    meta, 0.25)  # fmt: skip
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    mask[1:, 1:] = tree.ancestor_mask()
    span = RequestSpan(context, n, table, mask)
    meta = AttentionMetadata.build([span], block, torch.device("cpu"))
    out = paged_attention(q, k_all[context:], v_all[context:], *cache, meta, 0.25)
    visible = torch.cat([torch.ones(n, context, dtype=torch.bool), mask], dim=1)  # [n, total]
    keys = k_all.repeat_interleave(heads // kv_heads, 1)  # [total, heads, dim]
    values = v_all.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.25
    scores = scores.masked_fill(~visible, -math.inf).softmax(-1)
    reference = torch.einsum("hqk,khd->qhd", scores, values).reshape(n, -1)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_tree_forward_scores_each_node_as_its_own_path(plain: LLMEngine, vocab: int) -> None:
    """Every node's logits equal those of a forward over the context plus its path alone."""
    runner = plain.target
    prompt = _ambiguous_prompts(1, vocab)[0][:10]
    tree = DraftTree((11, 12, 13, 14, 15), (ROOT, 0, 0, ROOT, 3))
    table = list(range(100, 106))
    runner.forward([ForwardInput(prompt[:-1], 0, table, 0)])
    logits = runner.forward(
        [ForwardInput([prompt[-1], *tree.token_ids], 9, table, 6, 5, tree.parents)]
    )
    for node in [ROOT, *range(len(tree))]:
        path = prompt + tree.path_tokens(node)
        alone = runner.forward([ForwardInput(path, 0, list(range(200, 206)), 1)])
        torch.testing.assert_close(logits[node + 1], alone[0], rtol=1e-4, atol=1e-4)


# ---- engine: greedy, seeded and constrained output equal plain decoding -----------------------


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_trees_equal_plain(
    batch: int, plain: LLMEngine, tiny_model_dir: Path, vocab: int
) -> None:
    engine = _tree_engine(tiny_model_dir)
    spy = _Spy(engine)
    prompts = _ambiguous_prompts(batch, vocab)
    ks = [None, 0, 2, 6, 3, 6, 1, None][:batch]  # per request, including 0 (plain)
    params = [greedy(MAX_TOKENS, num_speculative_tokens=k) for k in ks]
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert spy.trees > 0 and sum(s.spec.num_accepted_tokens for s in seqs) > 0
    if batch > 1:
        assert spy.moved > 0  # some accepted path was another branch than the first
    assert engine.block_manager.usage == 0.0


def test_staggered_arrivals_and_prefix_cache(
    plain: LLMEngine, tiny_model_dir: Path, vocab: int
) -> None:
    """Requests joining a running batch step by step, then the same prompts again from the
    prefix cache (whose blocks hold K/V an accepted path moved into place)."""
    engine = _tree_engine(tiny_model_dir, num_kv_blocks=96)
    spy = _Spy(engine)
    prompts = _ambiguous_prompts(8, vocab)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
        engine.step()
    seqs = [engine.seqs[f"r{i}"] for i in range(len(prompts))]
    while engine.has_unfinished():
        engine.step()
    reference = outputs(plain, prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == reference
    assert outputs(engine, prompts, greedy(MAX_TOKENS)) == reference
    assert spy.trees > 0 and spy.moved > 0


def test_seeded_trees_equal_plain(plain: LLMEngine, tiny_model_dir: Path, vocab: int) -> None:
    engine = _tree_engine(tiny_model_dir)
    spy = _Spy(engine)
    prompts = _ambiguous_prompts(6, vocab, seed=9)
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True)
        for s in range(6)
    ]
    assert outputs(engine, prompts, params) == outputs(plain, prompts, params)
    assert spy.trees > 0


# ---- sampled: multi-step rejection sampling keeps the target's distribution ------------------

_TREE = DraftTree((1, 3, 0, 2, 4), (ROOT, ROOT, ROOT, 0, 1))  # siblings 1, 3, 0 at the root


def _first_two(tokens: list[int]) -> tuple[int, int]:
    return tokens[0], tokens[1] if len(tokens) > 1 else -1


def _exact_first_two(probs: torch.Tensor, tree: DraftTree) -> dict[tuple[int, int], float]:
    """P(first token, second token or -1): a drafted first token continues from its node's row,
    any other ends the step."""
    exact = {}
    for t1 in range(probs.shape[1]):
        node = next((c for c in tree.children(ROOT) if tree.token_ids[c] == t1), None)
        p1 = float(probs[0, t1])
        if node is None:
            exact[(t1, -1)] = p1
        else:
            for t2 in range(probs.shape[1]):
                exact[(t1, t2)] = p1 * float(probs[node + 1, t2])
    return exact


def _pvalue(samples: list[tuple[int, int]], exact: dict[tuple[int, int], float]) -> float:
    if any(s not in exact for s in samples):
        return 0.0  # an outcome of probability 0
    cells = sorted(exact)
    observed = np.array([sum(s == c for s in samples) for c in cells], dtype=float)
    expected = np.array([exact[c] for c in cells])
    expected = expected / expected.sum() * len(samples)
    return float(stats.chisquare(observed, expected).pvalue)


def _naive(probs: torch.Tensor, tree: DraftTree, gen: torch.Generator) -> list[int]:
    """The control: each sibling accepted with p(x) against the same p, no residual taken."""
    node, out = ROOT, []
    while True:
        p = probs[node + 1]
        nxt = None
        for child in tree.children(node):
            if float(torch.rand((), generator=gen)) < float(p[tree.token_ids[child]]):
                nxt = child
                break
        if nxt is None:
            return [*out, int(torch.multinomial(p, 1, generator=gen))]
        node = nxt
        out.append(tree.token_ids[nxt])


def test_tree_rejection_sampling_keeps_the_distribution() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(_TREE) + 1, 5, generator=gen) * 1.5  # [rows, V]
    params = SamplingParams(temperature=1.0, max_tokens=4)
    probs = torch.softmax(logits, -1)
    exact = _exact_first_two(probs, _TREE)
    draws = 6000
    samples = [
        _first_two(verify_tree(logits, _TREE, None, params, [], None, None, gen).tokens)
        for _ in range(draws)
    ]
    assert _pvalue(samples, exact) > 1e-3
    control = [_first_two(_naive(probs, _TREE, gen)) for _ in range(draws)]
    assert _pvalue(control, exact) < 1e-6  # the test can tell a biased sampler


def test_tree_rejection_sampling_with_draft_probs() -> None:
    """Siblings drawn i.i.d. from a draft's q (SpecInfer's multi-step case): the first token
    still follows p."""
    gen = torch.Generator().manual_seed(4)
    vocab = 6
    p_logits = torch.randn(3, vocab, generator=gen)
    q = torch.softmax(torch.randn(vocab, generator=gen), -1)
    params = SamplingParams(temperature=1.0, max_tokens=4)
    firsts = []
    for _ in range(6000):
        a, b = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
        tree = DraftTree((a, b), (ROOT, ROOT))
        result = verify_tree(p_logits, tree, q.expand(2, vocab), params, [], None, None, gen)
        firsts.append(result.tokens[0])
    observed = np.bincount(firsts, minlength=vocab)
    expected = torch.softmax(p_logits[0].double(), -1).numpy()
    expected = expected / expected.sum() * len(firsts)
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_sampled_trees_through_the_engine(tiny_model_dir: Path, vocab: int) -> None:
    """Unseeded sampling with n-gram trees: every request runs, trees are verified, and tokens
    stay in the vocabulary (the distribution is checked on the sampler itself above)."""
    engine = _tree_engine(tiny_model_dir)
    spy = _Spy(engine)
    prompts = _ambiguous_prompts(8, vocab, seed=13)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, ignore_eos=True)
    seqs = engine.generate(prompts, params)
    assert all(len(s.output_token_ids) == MAX_TOKENS for s in seqs) and spy.trees > 0
    assert all(0 <= t < vocab for s in seqs for t in s.output_token_ids)
    assert engine.block_manager.usage == 0.0


def test_grammar_masks_tree_nodes(plain: LLMEngine, tiny_model_dir: Path, vocab: int) -> None:
    """JSON-schema requests under trees: each node's row masked after its own path, output equal
    to plain decoding's and valid."""
    engine = _tree_engine(tiny_model_dir, width=3, k=6)
    spy = _Spy(engine)
    params = SamplingParams(
        max_tokens=120,
        temperature=0.0,
        constraints=Constraints(grammar=grammar_from("json", SCHEMA)),
    )
    # prompts quoting several JSON answers: their n-grams recur with different continuations
    answers = outputs(plain, _ambiguous_prompts(4, vocab, seed=17), params)
    prompts = [answers[i] + answers[(i + 1) % 4] + answers[(i + 2) % 4][:5] for i in range(4)]
    seqs = engine.generate(prompts, params)
    reference = plain.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in reference]
    assert all(s.finish_reason == "stop" for s in seqs) and spy.trees > 0
    for seq in seqs:
        text = engine.tokenizer.decode(seq.output_token_ids)
        jsonschema.validate(json.loads(text), SCHEMA)


# ---- metrics: acceptance per depth, mean accepted length --------------------------------------


def test_metrics_per_depth_and_mean_length(tiny_model_dir: Path, vocab: int) -> None:
    from server.metrics import PREFIX, Metrics

    engine = _tree_engine(tiny_model_dir)
    metrics = Metrics("tiny")
    prompts = _ambiguous_prompts(4, vocab, seed=21)
    for rid, prompt in enumerate(prompts):
        engine.add_request(str(rid), prompt, greedy(MAX_TOKENS))
    total = SpecStats()
    while engine.has_unfinished():
        engine.step()
        assert engine.last_stats is not None
        metrics.on_step(engine.last_stats)
        total.merge(engine.last_stats.spec)
    drafted, accepted = total.drafted_per_pos, total.accepted_per_pos
    assert total.num_drafts == drafted[0] > 0  # every pass offers depth 1
    assert all(a <= d for a, d in zip(accepted, drafted, strict=False))
    assert sum(drafted) < total.num_draft_tokens  # a tree counts by depth, not by its nodes
    text = metrics.render().decode()
    first = f'{PREFIX}spec_decode_num_drafts_per_pos_total{{model_name="tiny",position="0"}}'
    assert f"{first} {float(drafted[0])}" in text
    mean = 1 + total.num_accepted_tokens / total.num_drafts
    line = next(ln for ln in text.splitlines() if ln.startswith(f"{PREFIX}spec_decode_mean_acc"))
    assert float(line.split()[-1]) == pytest.approx(mean)
