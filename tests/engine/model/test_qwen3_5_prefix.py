"""Prefix caching for the hybrid Qwen3.5: a request sharing a prompt's prefix resumes from the
linear layers' state snapshotted at that prompt's last full block (engine/core/state_cache.py).
Greedy output equals the same engine's with prefix caching off, in every way of reaching the
snapshot (whole prompts, growing histories, chunks that do and do not land on block boundaries,
n-gram and MTP speculation, eviction, preemption), and the snapshot is really used: hits counted,
fewer prompt tokens computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_greedy, make_engine, random_prompts
from family_utils import MAX_TOKENS
from safetensors.torch import load_file, save_file
from test_qwen3_5_mtp import _add_mtp_weights
from tiny import make_tiny_qwen3_5

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sequence import Sequence

BLOCK = 4  # make_engine's block size
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)


def _slow_decay(model_dir: Path, seed: int) -> None:
    """Decays of 0.01..0.1 a token (A = exp(A_log) in [0.01, 0.1]): the tiny model's own (A up
    to 16) forget a token's state by the next, so a wrong resumed state would go unseen."""
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("linear_attn.A_log"):
            tensors[name] = torch.empty_like(tensor).uniform_(0.01, 0.1, generator=gen).log()
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3.5 with a long memory and MTP weights (so it serves the MTP case too)."""
    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_prefix"), seed=0)
    _slow_decay(path, seed=2)
    _add_mtp_weights(path, seed=5)
    return path


def _system(n: int = 23, seed: int = 3) -> list[int]:
    return random_prompts(1, (n, n), 300, seed)[0]


def _turns() -> list[list[int]]:
    """Three requests with a common 23-token system prompt, the last with a 2-token turn. The
    first snapshots only its own last full block; the second finds the
    system prompt's 5 full blocks' K/V cached but no state, recomputes them and snapshots their
    end; the third resumes there."""
    system = _system()
    users = random_prompts(2, (3, 9), 300, seed=11)
    return [system + users[0], system + users[1] * 2, system + [17, 18]]


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[Sequence], int]:
    """Each prompt after the previous one finished; returns the sequences and the prompt tokens
    the target computed."""
    seqs, computed = [], 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
        seq = engine.seqs[f"r{i}"]
        while engine.has_unfinished():
            engine.step()
            computed += engine.last_stats.num_prompt_tokens if engine.last_stats else 0
        seqs.append(seq)
    return seqs, computed


def _compare(model_dir: Path, prompts: list[list[int]], **config: object) -> list[Sequence]:
    """Greedy outputs with prefix caching on equal those with it off; returns the cached run's."""
    off, computed_off = _run(make_engine(model_dir, enable_prefix_caching=False, **config), prompts)
    engine = make_engine(model_dir, **config)
    on, computed_on = _run(engine, prompts)
    assert [s.output_token_ids for s in on] == [s.output_token_ids for s in off]
    hits = sum(s.num_cached_tokens for s in on)
    assert computed_on == computed_off - hits
    assert engine.scheduler.snapshots is not None
    assert engine.scheduler.snapshots.num_hits == sum(s.num_cached_tokens > 0 for s in on)
    return on


@pytest.mark.parametrize("chunk", [256, 8, 9, 7])
def test_shared_system_prompt(chunk: int, model_dir: Path) -> None:
    """The third request resumes at block 5 (20 tokens) of the shared 23-token system prompt;
    prompt chunks of 8 land on block boundaries, of 9 and 7 do not (the scheduler ends one
    there)."""
    seqs = _compare(model_dir, _turns(), max_num_batched_tokens=chunk)
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 20]


def test_growing_history_hits_inside_the_cached_prefix(model_dir: Path) -> None:
    """A second turn: the first turn's prompt, its reply and a new message. Its K/V prefix match
    runs through the reply's blocks, but the state was snapshotted at the first prompt's last
    full block, so the hit is cut there, in the middle of the block-aligned cached prefix."""
    first = _system() + [7, 8, 9]  # 26 tokens: snapshot at 24
    reply = hf_greedy(model_dir, first, MAX_TOKENS)
    second = first + reply + [5, 6, 7, 8, 9]
    seqs = _compare(model_dir, [first, second])
    engine = make_engine(model_dir)
    _run(engine, [first])
    assert len(engine.block_manager.match_prefix(second)) * BLOCK > 24  # K/V cached past it
    assert [s.num_cached_tokens for s in seqs] == [0, 24]
    assert seqs[1].output_token_ids == hf_greedy(model_dir, second, MAX_TOKENS)


def test_a_request_after_its_snapshot_was_evicted(model_dir: Path) -> None:
    """Two snapshots kept, three 24-token prefixes: C's evicts A's (the least recently used), so
    D (A's prefix) recomputes its whole prompt (its K/V blocks are still cached, but no state to
    resume from) and its snapshot evicts B's; E (C's prefix) still hits."""
    a, b, c = (_system(24, seed) for seed in (3, 4, 5))
    prompts = [a + [1, 2], b + [3, 4], c + [5, 6], a + [7, 8, 9], c + [9, 8]]
    seqs = _compare(model_dir, prompts, num_state_snapshots=2)
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0, 0, 24]


@pytest.mark.parametrize("spec", [NGRAM, MTP], ids=["ngram", "mtp"])
def test_with_speculation(spec: SpeculativeConfig, model_dir: Path) -> None:
    """Drafts verified (and rolled back) after a resumed prefix; the MTP head catches up over
    the cached positions' kept hidden states."""
    seqs = _compare(model_dir, _turns(), speculative=spec, max_num_batched_tokens=9)
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 20]
    assert sum(s.spec.num_draft_tokens for s in seqs) > 0


def test_preemption_with_caching_on(model_dir: Path) -> None:
    """Requests sharing a system prompt join while others decode in a KV pool too small for all;
    the preempted ones are readmitted through the prefix cache, resuming from the snapshot."""
    system = _system()
    prompts = [system + p for p in random_prompts(6, (2, 8), 300, seed=21)]
    refs = [hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts]
    engine = make_engine(model_dir, num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=16)
    engine.add_request("r0", prompts[0], greedy(MAX_TOKENS))
    seqs, preempted = [engine.seqs["r0"]], 0
    for step in range(400):
        if step == 3:
            for i, p in enumerate(prompts[1:], start=1):
                engine.add_request(f"r{i}", p, greedy(MAX_TOKENS))
                seqs.append(engine.seqs[f"r{i}"])
        if not engine.has_unfinished():
            break
        engine.step()
        preempted += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert [s.output_token_ids for s in seqs] == refs
    assert preempted > 0
    assert engine.scheduler.snapshots is not None and engine.scheduler.snapshots.num_hits > 0


def test_zero_snapshots_keeps_caching_off(model_dir: Path) -> None:
    """num_state_snapshots 0: today's behaviour, no prefix cache for a hybrid target."""
    engine = make_engine(model_dir, num_state_snapshots=0)
    seqs, _ = _run(engine, _turns())
    assert not engine.block_manager.enable_prefix_caching
    assert engine.scheduler.snapshots is None
    assert [s.num_cached_tokens for s in seqs] == [0, 0, 0]
