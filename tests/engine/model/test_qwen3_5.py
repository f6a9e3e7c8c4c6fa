"""The hybrid Qwen3.5 (Qwen3_5ForCausalLM) against transformers on tiny random float32 models:
Gated DeltaNet layers beside gated full attention, the per-request recurrent state, and
speculation that rolls that state back to the last accepted token.

The engine-level tests (greedy output against transformers' generate, rollback at every
rejection position, preemption, sampled distribution) are in test_qwen3_5_engine.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import hf_model
from family_utils import max_diff, prompt_ids
from tiny import make_tiny_qwen3_5
from transformers import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from engine.model.hybrid import HybridDecoderModel
from engine.model.linear_attention import chunked_delta_rule, l2norm, stepped_delta_rule
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner
from engine.model.state_pool import StateCommit

BLOCKS = 64
TABLE = list(range(BLOCKS - 1, -1, -1))  # shuffled: positions never in consecutive blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5"), seed=0)


def _runner(model_dir: Path, slots: int = 4) -> ModelRunner:
    runner = ModelRunner(load_model(str(model_dir)), "cpu", "float32", 4)
    runner.allocate_kv_cache(BLOCKS)
    runner.allocate_states(slots)
    return runner


def _forward(runner: ModelRunner, ids: list[int], start: int, slot: int, drafts: int = 0):  # type: ignore[no-untyped-def]
    return runner.forward([ForwardInput(ids, start, TABLE, len(ids), drafts, state_slot=slot)])


def test_layers_pools_and_refusals(model_dir: Path) -> None:
    runner = _runner(model_dir)
    model = runner.model
    assert isinstance(model, HybridDecoderModel) and runner.is_hybrid
    assert model.linear_layers == (0, 1, 2) and model.shape.norm_offset
    assert len(runner.kv_caches) == 1  # K/V for the one full-attention layer only
    assert runner.states is not None and len(runner.states.recurrent) == 3
    assert runner.num_state_slots == 4
    with pytest.raises(ValueError, match="only its final hidden state"):
        runner.keep_aux_hidden((1,))  # no EAGLE-3 features from a hybrid, only MTP's


def _random_rule_inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    heads, dk, dv = 4, 8, 16
    q, k = (torch.randn(1, n, heads, dk, generator=gen) for _ in range(2))
    v = torch.randn(1, n, heads, dv, generator=gen)
    g = -torch.rand(1, n, heads, generator=gen) * 3  # log decays
    beta = torch.rand(1, n, heads, generator=gen)
    state = torch.randn(1, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_delta_rule_forms_match_transformers(n: int) -> None:
    """Ours in [heads, n, dim] per request; transformers' in [batch, n, heads, dim]."""
    q, k, v, g, beta, state = _random_rule_inputs(n, seed=n)
    ours_args = [x[0].transpose(0, 1) for x in (q, k, v, g, beta)]
    ours_args[0], ours_args[1] = l2norm(ours_args[0]), l2norm(ours_args[1])
    theirs_kw = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, **theirs_kw)
    out, final = chunked_delta_rule(*ours_args, state[0])
    assert max_diff(out.transpose(0, 1), ref_out[0]) < 1e-5
    assert max_diff(final, ref_state[0]) < 1e-5
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **theirs_kw)
    out, states = stepped_delta_rule(*ours_args, state[0])
    assert torch.equal(out.transpose(0, 1), ref_out[0]) and torch.equal(states[-1], ref_state[0])


@torch.no_grad()
def _hf_chunked_logits(model_dir: Path, ids: list[int], sizes: tuple[int, ...]) -> torch.Tensor:
    """transformers over the same chunks with its cache: the chunked rule for several tokens,
    the stepped one for a single token, as ours."""
    model = hf_model(model_dir)
    cache, outs, pos = DynamicCache(config=model.config), [], 0
    for size in sizes:
        chunk = torch.tensor([ids[pos : pos + size]])
        outs.append(model(chunk, cache=cache, use_cache=True).logits[0])
        pos += size
    return torch.cat(outs)


@pytest.mark.parametrize("sizes", [(150,), (64, 64, 22), (7, 1, 4, 70, 1, 67)])
def test_prompt_chunks_match_transformers(model_dir: Path, sizes: tuple[int, ...]) -> None:
    """Chunks of any size (several of the rule's 64-token chunks, and single tokens) carry the
    conv and recurrent state from one to the next."""
    ids = prompt_ids(150, seed=3)
    runner = _runner(model_dir)
    outs, pos = [], 0
    for size in sizes:
        outs.append(_forward(runner, ids[pos : pos + size], pos, slot=1))
        pos += size
    # 1e-3: the chunked rule differences large cumulative decays, so float32 rounding elsewhere
    # (the native offset RMSNorm's) shows up ~10x larger; its two forms differ by 1.6e-3
    assert max_diff(torch.cat(outs), _hf_chunked_logits(model_dir, ids, sizes)) < 1e-3


@torch.no_grad()
def test_decode_steps_match_transformers_cached_decode(model_dir: Path) -> None:
    """Token by token, as transformers decodes with its cache (the stepped form of the rule;
    the chunked form of a whole prompt differs from it by ~1e-3 in transformers too)."""
    ids = prompt_ids(40, seed=4)
    model = hf_model(model_dir)
    cache = DynamicCache(config=model.config)
    prompt = model(torch.tensor([ids[:10]]), cache=cache, use_cache=True).logits[0]
    steps = [model(torch.tensor([[t]]), cache=cache, use_cache=True).logits[0] for t in ids[10:]]
    runner = _runner(model_dir)
    ours = [_forward(runner, ids[:10], 0, slot=2)]
    ours += [_forward(runner, [t], 10 + i, slot=2) for i, t in enumerate(ids[10:])]
    assert max_diff(torch.cat(ours), torch.cat([prompt, *steps])) < 1e-4


def test_two_requests_keep_their_own_states(model_dir: Path) -> None:
    """A batch of two requests in different slots gives each the logits it gets alone."""
    prompts, tables = (prompt_ids(30, seed=5), prompt_ids(30, seed=6)), (TABLE[0::2], TABLE[1::2])
    alone, batched = _runner(model_dir), _runner(model_dir)
    for start, end in ((0, 20), (20, 30)):
        inputs = [
            ForwardInput(p[start:end], start, table, end - start, state_slot=slot)
            for slot, (p, table) in enumerate(zip(prompts, tables, strict=True))
        ]
        one_by_one = torch.cat([alone.forward([i]) for i in inputs])
        assert max_diff(batched.forward(inputs), one_by_one) < 1e-5


def test_decodes_and_verifies_batched_give_what_each_gets_alone(model_dir: Path) -> None:
    """Three requests' decode tokens in one forward, then their verifies of 2 drafts in one,
    committed at different accepted counts: each gets the logits and the state it gets alone
    (GEMMs of 3 rows against 1 round differently in float32, hence the tolerance)."""
    prompts = [prompt_ids(12, seed=s) for s in (21, 22, 23)]
    tables = [TABLE[i::3] for i in range(3)]
    commits = [StateCommit(i, 10 + i) for i in range(3)]  # accepted 0, 1, 2 drafts

    def run(batched: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        runner, logits = _runner(model_dir), []
        for span, drafts in ((slice(0, 8), 0), (slice(8, 9), 0), (slice(9, 12), 2)):
            inputs = [
                ForwardInput(p[span], span.start, t, len(p[span]), drafts, state_slot=i)
                for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
            ]
            batches = [inputs] if batched else [[i] for i in inputs]
            for batch in batches:  # a commit after each forward, as the engine's step does
                logits.append(runner.forward(batch))
                runner.commit_states(commits)
        assert runner.states is not None
        out = torch.cat(logits)
        return out[24:27], out[27:], runner.states.recurrent  # 3 x 8 prompt rows first

    decode, verify, states = run(batched=True)
    decode_alone, verify_alone, states_alone = run(batched=False)
    assert max_diff(decode, decode_alone) < 1e-4 and max_diff(verify, verify_alone) < 1e-4
    for layer in range(3):
        assert max_diff(states[layer][:3], states_alone[layer][:3]) < 1e-5


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_commit_rolls_the_state_back_to_the_last_accepted_token(
    model_dir: Path, accepted: int
) -> None:
    """A verify of the last token and 3 drafts keeps 4 candidate states; committing the one at
    `accepted` drafts leaves the slot exactly as plain decoding of those tokens leaves it, and
    the next decode's logits agree."""
    ids = prompt_ids(24, seed=7)
    prompt, drafts = ids[:16], ids[16:19]
    plain, spec = _runner(model_dir), _runner(model_dir)
    for runner, slot in ((plain, 0), (spec, 3)):
        _forward(runner, prompt[:-1], 0, slot)
    for i, t in enumerate(prompt[-1:] + drafts[:accepted]):  # plain decoding, token by token
        _forward(plain, [t], 15 + i, slot=0)
    _forward(spec, prompt[-1:] + drafts, 15, slot=3, drafts=3)
    before = spec.states.recurrent[0][3].clone()  # type: ignore[union-attr]
    spec.commit_states([StateCommit(3, 16 + accepted)])
    assert spec.states is not None and plain.states is not None
    assert not torch.equal(spec.states.recurrent[0][3], before)  # the commit moved it
    for layer in range(3):
        assert max_diff(spec.states.conv[layer][3], plain.states.conv[layer][0]) < 1e-5
        assert max_diff(spec.states.recurrent[layer][3], plain.states.recurrent[layer][0]) < 1e-5
    nxt = ids[20]
    assert (
        max_diff(_forward(spec, [nxt], 16 + accepted, 3), _forward(plain, [nxt], 16 + accepted, 0))
        < 1e-5
    )


def test_a_candidate_that_does_not_exist_is_refused(model_dir: Path) -> None:
    runner = _runner(model_dir)
    ids = prompt_ids(12, seed=8)
    _forward(runner, ids[:8], 0, slot=0)
    _forward(runner, ids[8:], 8, slot=0, drafts=3)  # candidates at 9..12 tokens
    with pytest.raises(ValueError, match="no such candidate"):
        runner.commit_states([StateCommit(0, 13)])


@torch.no_grad()
def test_the_published_multimodal_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """Qwen3.5 is published as Qwen3_5ForConditionalGeneration (text config nested, weights
    under model.language_model, a vision tower beside): its text model is served."""
    text = hf_model(make_tiny_qwen3_5(tmp_path / "text", seed=2)).config.to_dict()
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
    config = hf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = hf.Qwen3_5ForConditionalGeneration(config).eval()
    folder = tmp_path / "vl"
    model.save_pretrained(str(folder))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tmp_path / "text" / name).read_bytes())
    loaded = load_model(str(folder))
    assert loaded.architecture == "Qwen3_5ForCausalLM"
    ids = prompt_ids(40, seed=12)
    runner = ModelRunner(loaded, "cpu", "float32", 4)
    runner.allocate_kv_cache(BLOCKS)
    runner.allocate_states(1)
    ours = _forward(runner, ids, 0, slot=0)
    assert max_diff(ours, model(torch.tensor([ids])).logits[0]) < 1e-3
