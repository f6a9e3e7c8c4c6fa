"""The engine against transformers: greedy equality across batching, chunking, preemption, prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_greedy, hf_model, make_engine, outputs, random_prompts

from engine.sample.sampling_params import SamplingParams

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def vocab(tiny_model_dir: Path) -> int:
    return hf_model(tiny_model_dir).config.vocab_size


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    return make_engine(tiny_model_dir)


def _reference(model_dir: Path, prompts: list[list[int]], n: int = MAX_TOKENS) -> list[list[int]]:
    return [hf_greedy(model_dir, p, n) for p in prompts]


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_matches_transformers_generate(
    engine, tiny_model_dir: Path, vocab: int, batch: int
) -> None:
    prompts = random_prompts(batch, (2, 40), vocab, seed=batch)
    assert outputs(engine, prompts, greedy(MAX_TOKENS)) == _reference(tiny_model_dir, prompts)
    assert engine.block_manager.usage == 0.0


def test_requests_join_while_others_run(engine, tiny_model_dir: Path, vocab: int) -> None:
    prompts = random_prompts(5, (3, 30), vocab, seed=11)
    engine.add_request("a0", prompts[0], greedy(MAX_TOKENS))
    engine.add_request("a1", prompts[1], greedy(MAX_TOKENS))
    results: dict[str, list[int]] = {}
    for step in range(200):
        if step == 3:
            for i in range(2, 5):
                engine.add_request(f"a{i}", prompts[i], greedy(MAX_TOKENS))
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished():
            break
    assert [results[f"a{i}"] for i in range(5)] == _reference(tiny_model_dir, prompts)


def test_chunked_prefill_matches(tiny_model_dir: Path, vocab: int) -> None:
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=7)
    prompts = random_prompts(3, (20, 45), vocab, seed=3)
    assert outputs(engine, prompts, greedy(MAX_TOKENS)) == _reference(tiny_model_dir, prompts)


def test_preemption_recomputes_and_matches(tiny_model_dir: Path, vocab: int) -> None:
    # 4 requests of up to ~40 positions need ~40 blocks of 4; give the pool 16 so some must yield.
    engine = make_engine(tiny_model_dir, num_kv_blocks=16)
    prompts = random_prompts(4, (20, 30), vocab, seed=5)
    preemptions = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, greedy(MAX_TOKENS))
    results: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        preemptions += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert preemptions > 0
    assert [results[f"p{i}"] for i in range(4)] == _reference(tiny_model_dir, prompts)
    assert engine.block_manager.num_free_blocks == 16


def test_prefix_cache_hits_and_matches(tiny_model_dir: Path, vocab: int) -> None:
    engine = make_engine(tiny_model_dir)
    shared = random_prompts(1, (33, 33), vocab, seed=7)[0]
    a, b = shared + [5, 6, 7], shared + [9, 10]
    first = engine.generate([a], greedy(MAX_TOKENS))[0]
    second = engine.generate([b], greedy(MAX_TOKENS))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32  # 8 full blocks of 4 shared
    assert [first.output_token_ids, second.output_token_ids] == _reference(tiny_model_dir, [a, b])
    assert engine.block_manager.num_hit_tokens >= 32


def test_abort_returns_every_block(tiny_model_dir: Path, vocab: int) -> None:
    engine = make_engine(tiny_model_dir, num_kv_blocks=64)
    for i, prompt in enumerate(random_prompts(6, (5, 30), vocab, seed=9)):
        engine.add_request(f"x{i}", prompt, greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < 64
    finals = [engine.abort(f"x{i}") for i in range(6)]
    assert all(out is not None and out.finish_reason == "abort" for out in finals)
    assert engine.block_manager.num_free_blocks == 64 and not engine.has_unfinished()


def test_seeded_sampling_is_independent_of_batch(engine, vocab: int) -> None:
    prompts = random_prompts(6, (4, 20), vocab, seed=13)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = outputs(engine, prompts[:1], params)[0]
    others = [SamplingParams(max_tokens=8, temperature=0.8, ignore_eos=True)] * 5
    mixed = outputs(engine, prompts, [params, *others])[0]
    again = outputs(engine, prompts[:1], params)[0]
    assert alone == mixed == again


def test_stops_cut_output(engine, tiny_model_dir: Path, vocab: int) -> None:
    prompt = random_prompts(1, (10, 10), vocab, seed=17)[0]
    ref = _reference(tiny_model_dir, [prompt], 12)[0]
    stop_at = ref[5]
    cut = ref.index(stop_at) + 1
    seq = engine.generate([prompt], greedy(12, stop_token_ids=(stop_at,)))[0]
    assert (
        seq.output_token_ids == ref[:cut]
        and seq.finish_reason == "stop"
        and seq.stop_reason == stop_at
    )
    seq = engine.generate([prompt], greedy(4))[0]
    assert seq.output_token_ids == ref[:4] and seq.finish_reason == "length"


def test_stop_string_cuts_text(engine, vocab: int) -> None:
    prompt = random_prompts(1, (8, 8), vocab, seed=19)[0]
    full = engine.generate([prompt], greedy(12))[0].detokenizer.text
    assert len(full) > 6
    stop = full[3:6]
    seq = engine.generate([prompt], greedy(12, stop=(stop,)))[0]
    assert seq.finish_reason == "stop" and seq.stop_reason == stop
    assert seq.detokenizer.text == full[: full.index(stop)]


def test_logprobs_are_transformers_log_softmax(engine, tiny_model_dir: Path, vocab: int) -> None:
    prompt = random_prompts(1, (9, 9), vocab, seed=23)[0]
    engine.add_request("lp", prompt, greedy(5, logprobs=3, prompt_logprobs=2))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    tokens = [t for o in outs for t in o.new_token_ids]
    sampled = [lp for o in outs for lp in (o.new_logprobs or [])]
    prompt_lps = outs[0].prompt_logprobs
    full = torch.tensor([prompt + tokens])
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(tiny_model_dir)(full).logits[0].float(), dim=-1)
    assert prompt_lps is not None and prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = prompt_lps[pos]
        assert entry is not None and entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(entry.top) == 2
    for i, entry in enumerate(sampled):
        row = ref[len(prompt) - 1 + i]
        assert entry.token_id == tokens[i]
        assert entry.logprob == pytest.approx(row[tokens[i]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


def test_rejects_requests_it_cannot_serve(engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.validate([], greedy(4))
    with pytest.raises(ValueError, match="context window"):
        engine.validate([5] * 10, greedy(engine.max_model_len))
