"""The hybrid Qwen3.5 served by the engine: greedy output equal to transformers' generate,
batched, concurrent, in small prompt chunks, under preemption, with and without speculation
(n-gram, a dense draft model, and drafts rejected at every position so that each request's
recurrent state is rolled back at every candidate); sampled pairs by chi-square."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_utils import chi_square_pvalue, greedy, hf_greedy, hf_model, make_engine, outputs
from family_utils import MAX_TOKENS, assert_greedy_equals_transformers, batched_prompts
from tiny import make_tiny_model, make_tiny_qwen3_5

from engine.config import SpeculativeConfig
from engine.sample.sampling_params import SamplingParams
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers import Proposal

K = 4
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=K, adaptive=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), seed=0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense 1-layer Qwen3 with the same tokenizer (a hybrid cannot be the draft)."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3-draft"), family="qwen3", num_layers=1)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, model_dir: Path, draft_dir: Path) -> None:
    assert_greedy_equals_transformers(kind, model_dir, draft_dir)


class RejectAt:
    """Drafts the reference continuation's next `right` tokens, then a wrong one: every verify
    accepts exactly `right` drafts (fewer where room runs out) and rejects the next."""

    name = "ngram"

    def __init__(self, references: dict[tuple[int, ...], list[int]], right: int, vocab: int):
        self.references, self.right, self.vocab = references, right, vocab
        self.num_rejected = 0

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        return [self._one(item) for item in batch]

    def _one(self, item: ScheduledSeq) -> Proposal:
        k = item.num_spec_tokens if item.reaches_end else 0
        seq = item.seq
        ahead = self.references[tuple(seq.prompt_token_ids)][seq.num_output_tokens :]
        drafts = ahead[: self.right] + [(t + 1) % self.vocab for t in ahead[self.right :][:1]]
        self.num_rejected += len(drafts[:k]) > self.right
        return Proposal(drafts[:k], source="ngram")


@pytest.mark.parametrize("right", range(K + 1))
def test_rollback_at_every_rejection_position(right: int, model_dir: Path) -> None:
    """Drafts rejected at position `right` of K (K: all accepted): the state each request
    continues from is the candidate at its last accepted token, so the output is transformers'."""
    prompts = batched_prompts()
    refs = {tuple(p): hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts}
    engine = make_engine(model_dir, speculative=NGRAM, max_num_batched_tokens=40)
    proposer = RejectAt(refs, right, engine.target.vocab_size)
    engine.proposer = proposer
    seqs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == [refs[tuple(p)] for p in prompts]
    accepted = sum(s.spec.num_accepted_tokens for s in seqs)
    assert accepted >= right * len(prompts)  # every request verified drafts and kept `right`
    assert (proposer.num_rejected > 0) == (right < K)
    assert sorted(engine.scheduler.free_state_slots) == list(range(32))  # every slot returned


def test_concurrent_arrivals_and_preemption(model_dir: Path, draft_dir: Path) -> None:
    """Requests join while others decode, in a KV pool too small for all: the preempted ones
    recompute from position 0 (their state from zeros) in whatever slot is free then."""
    spec = SpeculativeConfig(
        method="hybrid", num_speculative_tokens=3, draft_model=str(draft_dir), adaptive=False
    )
    engine = make_engine(
        model_dir, speculative=spec, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=16
    )
    prompts = batched_prompts()
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", p, greedy(MAX_TOKENS))
    seqs, preempted = [engine.seqs[f"r{i}"] for i in range(3)], 0
    for step in range(200):
        if step == 3:
            for i, p in enumerate(prompts[3:], start=3):
                engine.add_request(f"r{i}", p, greedy(MAX_TOKENS))
                seqs.append(engine.seqs[f"r{i}"])
        if not engine.has_unfinished():
            break
        engine.step()
        preempted += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert [s.output_token_ids for s in seqs] == refs
    assert preempted > 0  # not vacuous: some request was recomputed


def test_draft_trees_are_off_for_a_hybrid(model_dir: Path) -> None:
    """A tree's branches would each need a recurrent state: the hybrid verifies chains."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=K, tree_width=3, adaptive=False)
    engine = make_engine(model_dir, speculative=spec)
    prompts = batched_prompts()
    assert outputs(engine, prompts, greedy(MAX_TOKENS)) == [
        hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts
    ]


def test_prefix_caching_resumes_from_a_state_snapshot(model_dir: Path) -> None:
    """A repeated prompt resumes from the state snapshotted at its last full block before its
    last token (test_qwen3_5_prefix.py covers the rest); with no snapshots kept, nothing is
    served from the cache."""
    prompt = batched_prompts()[0] * 4  # 52 tokens: snapshot at 48
    for snapshots, hit in ((8, 48), (0, 0)):
        engine = make_engine(model_dir, num_state_snapshots=snapshots)
        first = outputs(engine, [prompt], greedy(MAX_TOKENS))
        (again,) = engine.generate([prompt], greedy(MAX_TOKENS))
        assert again.output_token_ids == first[0]
        assert again.num_cached_tokens == hit


def test_a_hybrid_draft_model_is_refused(model_dir: Path, draft_dir: Path) -> None:
    spec = SpeculativeConfig(method="draft", num_speculative_tokens=2, draft_model=str(model_dir))
    with pytest.raises(ValueError, match="cannot be the draft"):
        make_engine(draft_dir, speculative=spec)


TEMPERATURE = 0.5  # peaked enough that many pairs expect 5 or more of the samples
NUM_SAMPLES = 1500


def _exact_pair_probs(model_dir: Path, prompt: list[int]) -> np.ndarray:  # [vocab, vocab]
    model = hf_model(model_dir)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / TEMPERATURE, -1)
        vocab = first.shape[0]
        batch = torch.tensor([prompt + [t] for t in range(vocab)])
        second = torch.softmax(model(batch).logits[:, -1] / TEMPERATURE, -1)
    return (first[:, None] * second).double().numpy()


def test_sampled_pairs_follow_the_target_under_rejection_sampling(
    model_dir: Path, draft_dir: Path
) -> None:
    """Unseeded sampling verified by rejection sampling against a dense draft: a rejected draft's
    state is rolled back before the second token is drawn, so the pairs keep the target's law."""
    prompt = batched_prompts()[2]
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=2, draft_model=str(draft_dir), adaptive=False
    )
    engine = make_engine(
        model_dir,
        speculative=spec,
        num_kv_blocks=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    params = SamplingParams(max_tokens=2, temperature=TEMPERATURE, ignore_eos=True)
    seqs = engine.generate([prompt] * NUM_SAMPLES, params)
    pairs = [(s.output_token_ids[0], s.output_token_ids[1]) for s in seqs]
    drafted = sum(s.spec.num_draft_tokens for s in seqs)
    accepted = sum(s.spec.num_accepted_tokens for s in seqs)
    assert 0 < accepted < drafted  # rollbacks happened, and some drafts were kept
    assert len(set(pairs)) > 10
    assert chi_square_pvalue(pairs, _exact_pair_probs(model_dir, prompt)) > 1e-3
