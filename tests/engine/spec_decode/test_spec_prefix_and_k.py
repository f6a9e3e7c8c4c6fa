"""Speculation that never loses: draft K/V and the prefix cache, per-request k, the hybrid proposer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from engine_utils import greedy, make_engine, outputs, random_prompts

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sequence import ScheduledSeq
from engine.spec_decode.planner import PROBE_K
from engine.spec_decode.proposers import Proposal
from engine.spec_decode.step_cost import CostCurve


def _self_draft(model: Path, k: int = 4, **overrides: object) -> LLMEngine:
    """Draft = target: every draft must be accepted if the draft's K/V are right."""
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=k, draft_model=str(model), adaptive=False
    )
    return make_engine(model, speculative=spec, **overrides)


def _acceptance(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    seqs = engine.generate(prompts, greedy(max_tokens))
    rates = [seq.spec.acceptance_rate for seq in seqs]
    assert all(rate is not None for rate in rates), "the requests never drafted"
    return [float(rate) for rate in rates if rate is not None]


def test_prefix_served_plainly_first_keeps_full_acceptance(
    tiny_model_dir: Path, vocab: int
) -> None:
    engine = _self_draft(tiny_model_dir)
    shared = random_prompts(1, (45, 45), vocab, seed=11)[0]
    engine.generate([shared + [3]], greedy(8, num_speculative_tokens=0))  # plain: no draft K/V
    spec = engine.generate([shared + [4, 5]], greedy(16))[0]
    assert spec.num_cached_tokens == 44  # the plain request's blocks were reused by the target
    assert (
        spec.spec.acceptance_rate == 1.0
    )  # ... and the draft caught up on them, not used stale K/V
    # A speculative request leaves blocks whose draft K/V are valid: the next one starts drafting
    # from them with nothing to catch up on, and still accepts everything.
    again = engine.generate([shared + [4, 6]], greedy(16))[0]
    assert again.num_cached_tokens == 44 and again.spec.acceptance_rate == 1.0
    assert engine.block_manager.num_draft_computed(engine.block_manager.match_prefix(shared)) > 0


def test_full_acceptance_after_preemption_and_recompute(tiny_model_dir: Path, vocab: int) -> None:
    engine = _self_draft(tiny_model_dir, num_kv_blocks=24)
    prompts = random_prompts(4, (20, 30), vocab, seed=13)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, greedy(20))
    seqs = [engine.seqs[f"p{i}"] for i in range(4)]
    preemptions = 0
    while engine.has_unfinished():
        engine.step()
        preemptions += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert preemptions > 0
    assert [seq.spec.acceptance_rate for seq in seqs] == [1.0] * 4
    assert engine.block_manager.num_free_blocks == 24


def test_plain_request_does_not_run_the_draft(tiny_model_dir: Path, vocab: int) -> None:
    engine = _self_draft(tiny_model_dir)
    seq = engine.generate(
        random_prompts(1, (40, 40), vocab, seed=17), greedy(6, num_speculative_tokens=0)
    )[0]
    assert seq.num_draft_computed_tokens == 0 and seq.spec.num_draft_tokens == 0


class _Fixed(CostCurve):
    def __init__(self, seconds: Callable[[int], float]) -> None:
        super().__init__()
        self._of = seconds

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def seconds(self, rows: int) -> float:
        return self._of(rows) if rows > 0 else 0.0


class _ScriptedProposer:
    """Proposes the right continuation for 'good' requests and wrong tokens for 'bad' ones."""

    name = "draft"

    def __init__(self, futures: dict[str, list[int]], vocab: int) -> None:
        self.futures = futures
        self.vocab = vocab
        self.k_log: dict[str, list[int]] = {rid: [] for rid in futures}

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        return [self._one(item) for item in batch]

    def _one(self, item: ScheduledSeq) -> Proposal:
        seq, k = item.seq, item.k_for(self.name)
        if item.reaches_end:
            self.k_log[seq.request_id].append(k)
        if k == 0:
            return Proposal.empty()
        done = seq.num_output_tokens
        right = self.futures[seq.request_id][done : done + k]
        if seq.request_id.startswith("bad"):
            right = [(t + 1) % self.vocab for t in right]
        frontier = (
            seq.num_computed_tokens + item.num_new_tokens + len(right) - 1
        )  # as a draft would
        return Proposal(right, None, self.name, frontier) if right else Proposal.empty()


def test_request_k_drops_to_zero_for_failing_drafts_only(tiny_model_dir: Path, vocab: int) -> None:
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=4, draft_model=str(tiny_model_dir), adaptive=True
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    assert engine.planner is not None
    # Every verify row costs 0.3 of a one-row step and a draft forward a tenth of one, held fixed
    # against this host's timings (on a tiled kernel spare rows would be free, and even drafts
    # that rarely match would be worth their row).
    engine.costs.target = _Fixed(lambda m: 1 + 0.3 * (m - 1))
    engine.costs.draft = _Fixed(lambda m: 0.1 + 0.01 * m)
    prompts = random_prompts(2, (8, 12), vocab, seed=19)
    reference = outputs(make_engine(tiny_model_dir), prompts, greedy(80))
    proposer = _ScriptedProposer({"good": reference[0], "bad": reference[1]}, vocab)
    engine.proposer = proposer
    engine.add_request("good", prompts[0], greedy(80))
    engine.add_request("bad", prompts[1], greedy(80))
    seqs = [engine.seqs["good"], engine.seqs["bad"]]
    while engine.has_unfinished():
        engine.step()
    assert [seq.output_token_ids for seq in seqs] == reference  # lossless whatever k was
    # (from its second step: the step that gives a first token takes no drafts that slow it)
    bad, good = proposer.k_log["bad"][10:], proposer.k_log["good"][1:-4]
    assert sum(k > 0 for k in bad) <= len(bad) // 4 and max(bad) <= PROBE_K  # only re-probes
    assert min(good) > 0 and max(good) == 4  # the matching request kept drafting, and more
    assert seqs[0].spec.acceptance_rate == 1.0 and seqs[1].spec.num_accepted_tokens == 0


@pytest.mark.parametrize("batch", [1, 8])
def test_hybrid_greedy_equals_plain(
    batch: int, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    spec = SpeculativeConfig(
        method="hybrid",
        num_speculative_tokens=4,
        draft_model=str(tiny_draft_dir),
        ngram_min=2,
        ngram_max=3,
        adaptive=False,
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    repetitive = [p * 3 for p in random_prompts(batch, (4, 10), vocab, seed=23)]
    prompts = [
        p if i % 2 else random_prompts(1, (5, 40), vocab, seed=i)[0]
        for i, p in enumerate(repetitive)
    ]
    got = engine.generate(prompts, greedy(24))
    assert [s.output_token_ids for s in got] == outputs(
        make_engine(tiny_model_dir), prompts, greedy(24)
    )
    used = {name for s in got for name in s.spec.by_proposer}
    assert "draft" in used and (batch == 1 or "ngram" in used)
