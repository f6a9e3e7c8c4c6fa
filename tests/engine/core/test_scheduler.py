"""Scheduler on its own, with mock sequences: budgets, admission, preemption, progress."""

from __future__ import annotations

import time

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.outputs import RequestTimes
from engine.sample.sampling_params import SamplingParams
from engine.sequence import SeqResult, Sequence, SequenceStatus

BS = 4


class _NoDetokenizer:
    def append(self, token_id: int) -> None:
        return None  # no text, so no stop string


def _seq(rid: str, prompt_len: int, k: int = 0, max_tokens: int = 32) -> Sequence:
    return Sequence(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        times=RequestTimes(arrival=time.monotonic()),
        detokenizer=_NoDetokenizer(),  # type: ignore[arg-type]
        seed_stream=None,
        num_speculative_tokens=k,
    )


def _scheduler(num_blocks: int, budget: int = 64, k: int = 0, max_seqs: int = 8) -> Scheduler:
    spec = (
        SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False)
        if k
        else SpeculativeConfig()
    )
    config = EngineConfig(
        model="unused", block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
        speculative=spec,
    )  # fmt: skip
    return Scheduler(config, BlockManager(num_blocks, BS), max_model_len=1024)


def _run_step(sched: Scheduler, sampled: int = 7) -> list[tuple[str, int, int]]:
    """Schedule, then feed back what a forward would have produced (no drafts accepted)."""
    out = sched.schedule()
    plan = [
        (item.seq.request_id, item.num_new_tokens, item.num_spec_tokens) for item in out.scheduled
    ]
    for item in out.scheduled:
        sched.update_from_output(item, SeqResult([sampled] if item.reaches_end else []))
    return plan


def test_chunked_prefill_within_the_token_budget() -> None:
    sched = _scheduler(64, budget=10)
    a, b = _seq("a", 14), _seq("b", 3)
    sched.add(a)
    sched.add(b)
    assert _run_step(sched) == [("a", 10, 0)]  # a's chunk takes the whole budget
    assert _run_step(sched) == [("a", 4, 0), ("b", 3, 0)]
    assert _run_step(sched) == [("a", 1, 0), ("b", 1, 0)]  # both decode now
    assert a.num_computed_tokens == 15 and b.num_computed_tokens == 4


def test_decodes_go_before_prefill_chunks() -> None:
    sched = _scheduler(64, budget=8)
    a = _seq("a", 2)
    sched.add(a)
    _run_step(sched)
    sched.add(_seq("b", 20))
    _run_step(sched)  # b starts prefilling
    assert _run_step(sched)[0] == ("a", 1, 0)


def test_max_num_seqs_caps_admission() -> None:
    sched = _scheduler(64, max_seqs=2)
    for rid in "abc":
        sched.add(_seq(rid, 3))
    assert [r for r, _, _ in _run_step(sched)] == ["a", "b"]
    assert len(sched.waiting) == 1


def test_preemption_frees_the_newest_and_admits_nothing_that_step() -> None:
    # 6 blocks: a (8 prompt) and b (8 prompt) take 2 each (3 each once they pass position 8).
    sched = _scheduler(6, budget=64)
    a, b = _seq("a", 8), _seq("b", 8)
    sched.add(a)
    sched.add(b)
    _run_step(sched)  # both prefill: 4 blocks, then each needs a third block to decode
    sched.add(_seq("c", 2))
    blocks_before = sched.blocks.num_free_blocks
    out = sched.schedule()
    assert blocks_before == 2 and out.num_preempted == 0  # 9 positions each: a 3rd block each
    for item in out.scheduled:
        sched.update_from_output(item, SeqResult([7]))
    # Fill the blocks up so the next growth must preempt.
    for seq in (a, b):
        seq.token_ids += [7] * 3
        seq.num_computed_tokens += 3
    out = sched.schedule()
    assert out.num_preempted >= 1
    assert (
        b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_hashes == []
    )
    assert [item.seq.request_id for item in out.scheduled] == ["a"]  # c was not admitted now
    assert list(sched.waiting)[0] is b  # the preempted request goes back to the front


def test_update_from_output_is_the_one_place_progress_moves() -> None:
    sched = _scheduler(64, k=3)
    seq = _seq("a", 8, k=3)
    sched.add(seq)
    out = sched.schedule()
    item = out.scheduled[0]
    assert item.num_spec_tokens == 3 and item.k_for("ngram") == 3
    # two accepted drafts plus the recovered token
    result = SeqResult([5, 6, 7], num_drafts=3, proposer="ngram", num_draft_computed=11)
    assert sched.update_from_output(item, result) == 3
    assert seq.output_token_ids == [5, 6, 7] and seq.spec.by_proposer == {"ngram": [3, 2]}
    assert seq.num_computed_tokens == 10  # 8 prompt + 2 accepted drafts; the rejected one is not
    assert seq.num_draft_computed_tokens == 10  # clamped to what the target kept
    assert len(seq.block_hashes) == 2  # both full blocks registered, incrementally


def test_room_caps_drafts_at_max_tokens() -> None:
    sched = _scheduler(64, k=6)
    seq = _seq("a", 4, k=6, max_tokens=3)
    sched.add(seq)
    assert sched.schedule().scheduled[0].num_spec_tokens == 2  # max_tokens - 0 outputs - 1
