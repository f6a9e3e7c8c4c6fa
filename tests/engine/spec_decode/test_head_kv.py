"""The head's K/V in the target's KV slots (engine/model/head_kv.py): below the head's frontier it is
always what a fresh catch-up over the request's own tokens computes, through chunked prefill,
preemption and prefix-cache hits; a cached prefix is not caught up on again; and no head forward
runs over more than one prefill chunk."""

from __future__ import annotations

from pathlib import Path

import torch
from engine_utils import greedy, outputs, random_prompts
from test_eagle3 import MAX_TOKENS, eagle3_engine, head_dir, write_head

from engine.core.llm_engine import LLMEngine
from engine.model.head_kv import HeadCache, HeadSpan
from engine.sequence import Sequence
from engine.spec_decode.proposers import Eagle3Proposer

__all__ = ["head_dir"]  # the fixture, shared with test_eagle3


def _proposer(engine: LLMEngine) -> Eagle3Proposer:
    head = engine._eagle3
    assert isinstance(head, Eagle3Proposer)
    head.timings = []  # record each head forward's rows
    return head


def _head_rows(head: Eagle3Proposer) -> list[int]:
    return [rows for rows, _ in head.take_timings()]


def _check_head_kv(engine: LLMEngine, head: Eagle3Proposer, seq: Sequence) -> int:
    """The head's K/V of positions [0, frontier) in the pool against a fresh catch-up over the
    target's kept features of the same positions; returns the frontier."""
    frontier = seq.num_draft_computed_tokens
    if frontier == 0:
        return 0
    aux = engine.target.aux_hidden(seq.block_table, 0, frontier)
    tokens = torch.tensor(seq.token_ids[1 : frontier + 1])
    fresh = HeadCache(*head.pool.k.shape[1:], head.pool.k.dtype, head.pool.k.device)  # type: ignore[union-attr]
    head.head(head.head.fuse(aux), tokens, [HeadSpan(fresh, 0, frontier)])
    assert head.pool is not None
    kept = head.pool.cache(seq.block_table).prefix(frontier)
    for got, want in zip(kept, fresh.prefix(frontier), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    return frontier


def _run_checked(engine: LLMEngine, head: Eagle3Proposer) -> int:
    """Step to the end, checking every running request's head K/V after each step; returns the
    positions checked."""
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            checked += _check_head_kv(engine, head, seq)
    return checked


def test_head_kv_is_a_fresh_catch_up_through_chunks_and_preemption(
    tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    engine = eagle3_engine(tiny_model_dir, head_dir, num_kv_blocks=16, max_num_batched_tokens=9)
    head = _proposer(engine)
    for i, prompt in enumerate(random_prompts(4, (16, 30), vocab, seed=43)):
        engine.add_request(f"chunked-{i}", prompt, greedy(MAX_TOKENS))
    preempted, checked = 0, 0
    while engine.has_unfinished():
        engine.step()
        preempted += engine.last_stats.num_preemptions if engine.last_stats else 0
        checked += sum(_check_head_kv(engine, head, s) for s in engine.scheduler.running)
    assert preempted > 0 and checked > 0


def test_a_cached_prefix_is_not_caught_up_on_again(
    plain: LLMEngine, tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    """A second request whose prompt starts with a first one's finds the head's K/V of the shared
    blocks, the same as a fresh catch-up's, and runs the head over its own tail only; with prefix
    caching off it runs over all of it."""
    prompt = random_prompts(1, (40, 40), vocab, seed=9)[0]
    second = [prompt + tail for tail in random_prompts(2, (3, 5), vocab, seed=10)]
    rows = {}
    for caching in (True, False):
        engine = eagle3_engine(tiny_model_dir, head_dir, enable_prefix_caching=caching)
        head = _proposer(engine)
        engine.generate([prompt], greedy(MAX_TOKENS))
        head.take_timings()
        engine.add_request("second", second[0], greedy(MAX_TOKENS))
        engine.add_request("third", second[1], greedy(MAX_TOKENS))
        seqs = list(engine.seqs.values())[-2:]
        engine.step()  # the prompts' step: the head catches up on the hit's last position
        rows[caching] = sum(_head_rows(head))
        engine.step()  # their first drafting step: its first forward catches up on the tails
        rows[caching] += _head_rows(head)[0]
        assert _run_checked(engine, head) > 0
        assert seqs[0].num_cached_tokens == (40 if caching else 0)
        assert [s.output_token_ids for s in seqs] == outputs(plain, second, greedy(MAX_TOKENS))
    assert rows[False] == sum(map(len, second)), rows
    assert rows[True] == sum(len(s) - 39 for s in second), rows


def test_no_head_forward_runs_over_more_than_a_chunk(
    plain: LLMEngine, tiny_model_dir: Path, vocab: int, tmp_path: Path
) -> None:
    """A 60-token prompt in chunks of 8: the head catches up on each chunk in the next step, so
    its first drafting step does not run over the whole prompt."""
    head_dir = write_head(tmp_path / "head", tiny_model_dir, list(range(vocab)), seed=3)
    engine = eagle3_engine(tiny_model_dir, head_dir, max_num_batched_tokens=8)
    head = _proposer(engine)
    prompt = random_prompts(1, (60, 60), vocab, seed=11)
    seqs = engine.generate(prompt, greedy(MAX_TOKENS))
    assert seqs[0].output_token_ids == outputs(plain, prompt, greedy(MAX_TOKENS))[0]
    assert seqs[0].spec.num_draft_tokens > 0
    rows = _head_rows(head)
    assert sum(rows) >= 60 and max(rows) <= 8, rows
