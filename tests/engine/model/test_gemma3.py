"""Gemma 3 text models (Gemma3ForCausalLM) served exactly: our decoder with Gemma's switches on,
against transformers' own Gemma 3 on tiny random models (float32), with prompts longer than the
local layers' sliding window so that the window decides the logits."""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_greedy, hf_model, make_engine, outputs, random_prompts
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from engine.config import SpeculativeConfig
from engine.kernels import attention_ops
from engine.model.attention import AttentionMetadata, RequestSpan
from engine.model.families import build_decoder
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ForwardInput, ModelRunner

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
# different bases (and scaling) per layer type: a layer rotating with the other's table shows
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
}
GEMMA3 = dict(
    family="gemma3",
    num_layers=4,
    layer_types=LAYER_TYPES,
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,  # not head_dim (16): a scale taken from head_dim shows
    rope_parameters=ROPE,
)
ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3"), seed=0, **GEMMA3)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gemma_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Gemma 3 draft (one local layer, one global), other weights (seed 1)."""
    draft = GEMMA3 | dict(num_layers=2, layer_types=LAYER_TYPES[1:3])
    return make_tiny_model(tmp_path_factory.mktemp("gemma3-draft"), seed=1, **draft)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def loaded(gemma_dir: Path) -> LoadedModel:
    return load_model(str(gemma_dir))


def _runner(loaded: LoadedModel) -> ModelRunner:
    runner = ModelRunner(loaded, "cpu", "float32", BLOCK_SIZE)
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


def _ids(n: int, seed: int) -> list[int]:
    return random_prompts(1, (n, n), 300, seed)[0]


def _table(blocks: int, seed: int) -> list[int]:
    """Shuffled (non-contiguous) block ids."""
    ids = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    return ids[:blocks]


@torch.no_grad()
def _reference(model_dir: Path, ids: list[int], **config: object) -> torch.Tensor:  # [len, V]
    ref = hf_model(model_dir) if not config else _hf_with(model_dir, **config)
    return ref(torch.tensor([ids])).logits[0].float()


def _hf_with(model_dir: Path, **config: object) -> torch.nn.Module:
    """transformers' model with config overrides (`dtype`: loaded in it, float32 by default)."""
    dtype = config.pop("dtype", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **config)
    return model.eval()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff}"


# ---- the decoder's configuration --------------------------------------------------------------


def test_gemma3_is_the_decoder_with_gemma_switches(loaded: LoadedModel) -> None:
    assert loaded.architecture == "Gemma3ForCausalLM"
    assert loaded.hf_config.model_type == "gemma3_text"
    shape = build_decoder(loaded.architecture, loaded.hf_config).shape
    assert shape.norm_offset and shape.sandwich_norms and shape.qk_norm
    assert shape.activation == "gelu_tanh" and shape.embed_scale == 64**0.5
    assert shape.attention_scale == 24**-0.5 and shape.tie_word_embeddings
    assert shape.sliding_window == WINDOW and shape.layer_types == tuple(LAYER_TYPES)
    # the window is honoured, so the context is not clipped to it
    assert _runner(loaded).max_model_len == loaded.hf_config.max_position_embeddings


@pytest.mark.parametrize(
    "setting",
    [
        {"final_logit_softcapping": 30.0},
        {"attn_logit_softcapping": 50.0},
        {"hidden_activation": "silu"},
    ],
)
def test_settings_the_decoder_lacks_are_refused_by_name(setting: dict[str, object]) -> None:
    config = Gemma3TextConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, **setting,
    )  # fmt: skip
    with pytest.raises(ValueError, match=next(iter(setting))):
        build_decoder("Gemma3ForCausalLM", config)


def test_windowed_group_reads_the_last_window_keys_only() -> None:
    """Query at position p of a local layer sees keys (p - window, p]; blocks before the first
    query's window are not read at all."""
    span = RequestSpan(start_pos=20, num_tokens=3, block_table=list(range(100, 106)))
    meta = AttentionMetadata.build([span], BLOCK_SIZE, torch.device("cpu"), sliding_window=4)
    (full,) = meta.groups
    assert full.start_pos is not None and full.block_tables.shape == (1, 6)
    assert meta.sliding is not None
    (group,) = meta.sliding.groups
    # the native kernel takes the window, and the table from the window's first block
    assert group.start_pos is not None and group.window == 4
    assert group.block_tables.tolist() == [[104, 105]]  # positions 16..23
    assert group.mask is not None
    seen = group.mask[0, 0] == 0  # [3, 8]: the additive bias of a short group
    for j, p in enumerate(range(20, 23)):
        positions = [16 + k for k in seen[j].nonzero().flatten().tolist()]
        assert positions == list(range(p - 3, p + 1))


# ---- logits against transformers ---------------------------------------------------------------


def test_logits_match_transformers_past_the_window(loaded: LoadedModel, gemma_dir: Path) -> None:
    ids = _ids(40, seed=1)
    logits = _runner(loaded).forward([ForwardInput(ids, 0, _table(10, 0), len(ids))])
    want = _reference(gemma_dir, ids)
    _assert_close(logits, want)
    # the window decides these logits: transformers without it gives other ones past it
    unwindowed = _reference(gemma_dir, ids, sliding_window=1000)
    _assert_close(logits[:WINDOW], unwindowed[:WINDOW])
    assert (logits[WINDOW + 1 :] - unwindowed[WINDOW + 1 :]).abs().max() > 1e-2


def test_chunks_decodes_and_verify_queries_match_transformers(
    loaded: LoadedModel, gemma_dir: Path
) -> None:
    """Prompt chunks (long and short groups) and single decodes crossing the window."""
    runner = _runner(loaded)
    ids = _ids(45, seed=2)
    table = _table(12, 1)
    outs, pos = [], 0
    for size in (5, 1, 3, 20, 1, 1, 4, 2, 100):
        chunk = ids[pos : pos + size]
        outs.append(runner.forward([ForwardInput(chunk, pos, table, len(chunk))]))
        pos += len(chunk)
    _assert_close(torch.cat(outs), _reference(gemma_dir, ids))


def test_ragged_batch_matches_transformers(loaded: LoadedModel, gemma_dir: Path) -> None:
    """A prompt chunk, a decode and a 4-token verify query past the window, in one forward."""
    runner = _runner(loaded)
    seqs = [_ids(n, seed=10 + n) for n in (30, 14, 25)]
    tables = [_table(64, 5)[i * 12 : (i + 1) * 12] for i in range(3)]
    first = [12, 13, 21]
    runner.forward(
        [ForwardInput(s[:n], 0, t, 0) for s, t, n in zip(seqs, tables, first, strict=True)]
    )
    step = [
        ForwardInput(s[n:], n, t, len(s) - n) for s, t, n in zip(seqs, tables, first, strict=True)
    ]
    got = runner.forward(step)
    want = [_reference(gemma_dir, s)[n:] for s, n in zip(seqs, first, strict=True)]
    _assert_close(got, torch.cat(want))


@pytest.mark.skipif(not attention_ops.available(), reason="no native attention kernel here")
def test_local_layers_decode_on_the_native_kernel_with_their_window(
    loaded: LoadedModel, gemma_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decodes and a verify query past the window: the local layers' attention runs in the native
    kernel with the window (the global ones without), and the logits are transformers'."""
    windows: list[int] = []
    kernel = attention_ops.paged_attention

    def counted(*args: object, window: int = 0, **kw: object) -> torch.Tensor:
        windows.append(window)
        return kernel(*args, window=window, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_ops, "paged_attention", counted)
    runner, ids, table = _runner(loaded), _ids(30, seed=6), _table(10, 2)
    outs = [runner.forward([ForwardInput(ids[:20], 0, table, 20)])]
    outs.append(runner.forward([ForwardInput(ids[20:24], 20, table, 4)]))
    outs += [runner.forward([ForwardInput([ids[p]], p, table, 1)]) for p in range(24, 30)]
    _assert_close(torch.cat(outs), _reference(gemma_dir, ids))
    # the verify and the six decodes; the 20-token prompt chunk is SDPA's
    assert windows == [WINDOW if t == "sliding_attention" else 0 for t in LAYER_TYPES] * 7


# ---- the engine: greedy continuations equal transformers' generate ------------------------------


def _prompts() -> list[list[int]]:
    """Short and long prompts (past the window), two sharing a 24-token prefix (the prefix cache),
    and repetitive ones (n-gram matches)."""
    short_long = random_prompts(4, (3, 40), 300, seed=7)
    shared = _ids(24, seed=8)
    repeats = [p * 3 + p[:2] for p in random_prompts(2, (4, 9), 300, seed=9)]
    return short_long + [shared + _ids(6, seed=11), shared + _ids(9, seed=12)] + repeats


@cache
def _hf_outputs(model_dir: Path) -> list[list[int]]:
    return [hf_greedy(model_dir, p, MAX_TOKENS) for p in _prompts()]


def _spec(kind: str, target: Path, draft: Path) -> SpeculativeConfig:
    if kind == "none":
        return SpeculativeConfig()
    if kind == "ngram":
        return SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, ngram_max=3, adaptive=False
        )
    model = str(draft if kind == "draft" else target)
    return SpeculativeConfig(
        method="draft", num_speculative_tokens=3, draft_model=model, adaptive=False
    )


@pytest.mark.parametrize("kind", ["none", "ngram", "draft", "self-draft"])
def test_greedy_equals_transformers_batched_chunked_and_prefix_cached(
    kind: str, gemma_dir: Path, gemma_draft_dir: Path
) -> None:
    """All prompts at once, prefills in chunks of 9 tokens, then the same prompts again (their
    prefixes now cached): every continuation is transformers' own."""
    engine = make_engine(
        gemma_dir, speculative=_spec(kind, gemma_dir, gemma_draft_dir), max_num_batched_tokens=9
    )
    prompts, want = _prompts(), _hf_outputs(gemma_dir)
    seqs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == want
    if kind != "none":
        assert sum(s.spec.num_draft_tokens for s in seqs) > 0
    if kind == "self-draft":
        assert all(s.spec.num_accepted_tokens == s.spec.num_draft_tokens for s in seqs)
    assert outputs(engine, prompts[::-1], greedy(MAX_TOKENS)) == want[::-1]
    assert engine.block_manager.num_hit_tokens > 0
    assert engine.block_manager.usage == 0.0


def test_gemma3_draft_for_its_own_family_in_one_at_a_time_requests(
    gemma_dir: Path, gemma_draft_dir: Path
) -> None:
    """Each prompt alone (a batch of one: decodes take the short-query path throughout)."""
    engine = make_engine(gemma_dir, speculative=_spec("draft", gemma_dir, gemma_draft_dir))
    for prompt, want in zip(_prompts()[:4], _hf_outputs(gemma_dir), strict=False):
        assert outputs(engine, [prompt], greedy(MAX_TOKENS)) == [want]


def test_requests_joining_running_ones_and_preempted_match_transformers(
    gemma_dir: Path, gemma_draft_dir: Path
) -> None:
    """Requests arrive while others decode, in a pool too small for all (preemption, then
    recompute), with the draft model speculating."""
    spec = _spec("draft", gemma_dir, gemma_draft_dir)
    engine = make_engine(gemma_dir, speculative=spec, num_kv_blocks=24)
    prompts, want = _prompts(), _hf_outputs(gemma_dir)
    arrivals = {0: [0, 1], 2: [2, 3, 4], 5: [5, 6, 7]}  # step -> prompts added before it
    results: dict[int, list[int]] = {}
    preemptions = 0
    for step in range(400):
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompts[i], greedy(MAX_TOKENS))
        for out in engine.step():
            results.setdefault(int(out.request_id), []).extend(out.new_token_ids)
        preemptions += engine.last_stats.num_preemptions if engine.last_stats else 0
        if step > 5 and not engine.has_unfinished():
            break
    assert preemptions > 0
    assert [results[i] for i in range(len(prompts))] == want
    assert engine.block_manager.num_free_blocks == 24


# ---- half precision and other devices ----------------------------------------------------------


def _runner_logits(loaded: LoadedModel, ids: list[int], device: str, dtype: str) -> torch.Tensor:
    """A prompt chunk, a 4-token verify query and two decodes, all past the window."""
    runner = ModelRunner(loaded, device, dtype, BLOCK_SIZE)
    runner.allocate_kv_cache(NUM_BLOCKS)
    table = _table(16, 3)
    split = len(ids) - 6
    prefill = runner.forward([ForwardInput(ids[:split], 0, table, split)])
    verify = runner.forward([ForwardInput(ids[split : split + 4], split, table, 4)])
    decodes = [
        runner.forward([ForwardInput([ids[p]], p, table, 1)]) for p in (split + 4, split + 5)
    ]
    return torch.cat([prefill, verify, *decodes]).cpu()


def test_bfloat16_as_accurate_as_transformers(loaded: LoadedModel, gemma_dir: Path) -> None:
    """Gemma's norms round once, after the (1 + weight) scale, as transformers' do: in bfloat16
    our error against float32 is no worse than transformers' own."""
    ids = _ids(36, seed=4)
    ours = _runner_logits(loaded, ids, "cpu", "bfloat16")
    half = _reference(gemma_dir, ids, dtype=torch.bfloat16)
    gold = _reference(gemma_dir, ids)
    ours_err, theirs_err = ((x - gold).abs().max().item() for x in (ours, half))
    assert ours_err <= 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_transformers(loaded: LoadedModel, gemma_dir: Path) -> None:
    """On a GPU a fresh prompt's full layers take SDPA's is_causal; its local layers, a mask."""
    ids = _ids(36, seed=5)
    _assert_close(_runner_logits(loaded, ids, "cuda", "float32"), _reference(gemma_dir, ids))
