"""Our forward pass against transformers' on the same weights (float32), through the paged cache."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tiny import make_tiny_model
from transformers import AutoModelForCausalLM, GPT2Config

from engine.model import attention
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ForwardInput, ModelRunner

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 96

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}

VARIANTS: dict[str, dict[str, object]] = {
    "llama": dict(family="llama", tie_word_embeddings=False),
    "llama-tied": dict(family="llama", tie_word_embeddings=True),
    "llama3-rope": dict(family="llama", rope_parameters=LLAMA3_ROPE),
    "qwen2": dict(family="qwen2", tie_word_embeddings=True),
    "qwen2-untied": dict(family="qwen2", tie_word_embeddings=False),
    "qwen2-yarn": dict(family="qwen2", rope_parameters=YARN_ROPE),
    "qwen3": dict(family="qwen3", tie_word_embeddings=True),
    "qwen3-untied": dict(family="qwen3", tie_word_embeddings=False),
    "mistral": dict(family="mistral", tie_word_embeddings=False, num_kv_heads=1),
    "mistral-mha": dict(family="mistral", tie_word_embeddings=True, num_kv_heads=4),
}

PROMPTS = [
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1)",
    "naïve café 日本語 😀",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs.",
]


class Pair:
    """A tiny model loaded both ways: our runner and the transformers reference."""

    def __init__(self, path: Path) -> None:
        self.loaded: LoadedModel = load_model(str(path))
        self.ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def runner(self) -> ModelRunner:
        runner = ModelRunner(self.loaded, "cpu", "float32", BLOCK_SIZE)
        runner.allocate_kv_cache(NUM_BLOCKS)
        return runner

    def tokens(self, text: str) -> list[int]:
        return list(self.loaded.tokenizer(text)["input_ids"])

    @torch.no_grad()
    def reference(self, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
        return self.ref(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    path = tmp_path_factory.mktemp(f"model-{request.param}")
    return Pair(make_tiny_model(path, **VARIANTS[request.param]))  # type: ignore[arg-type]


def _block_tables(num_requests: int, blocks_each: int, seed: int) -> list[list[int]]:
    """Disjoint, shuffled (non-contiguous) block ids per request."""
    ids = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    return [ids[i * blocks_each : (i + 1) * blocks_each] for i in range(num_requests)]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff}"


def test_whole_prompt_one_forward(pair: Pair) -> None:
    runner = pair.runner()
    ids = pair.tokens(PROMPTS[0])
    [table] = _block_tables(1, 24, seed=0)
    logits = runner.forward([ForwardInput(ids, 0, table, len(ids))])
    _assert_close(logits, pair.reference(ids))


def test_chunked_prefill(pair: Pair) -> None:
    runner = pair.runner()
    ids = pair.tokens(PROMPTS[0] + PROMPTS[3])
    [table] = _block_tables(1, 40, seed=1)
    outs, pos = [], 0
    for size in (7, 1, 3, 20, 4, 1, 100):
        chunk = ids[pos : pos + size]
        outs.append(runner.forward([ForwardInput(chunk, pos, table, len(chunk))]))
        pos += len(chunk)
    assert pos == len(ids)
    _assert_close(torch.cat(outs), pair.reference(ids))


def test_num_logits_selects_last_positions(pair: Pair) -> None:
    runner = pair.runner()
    ids = pair.tokens(PROMPTS[2])
    [table] = _block_tables(1, 16, seed=2)
    logits = runner.forward([ForwardInput(ids, 0, table, 3)])
    _assert_close(logits, pair.reference(ids)[-3:])
    none = runner.forward([ForwardInput([ids[0]], 0, table, 0)])
    assert none.shape == (0, runner.vocab_size)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_limited_head_scores_the_first_ids_and_stop_ids_alike(
    pair: Pair, quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head limited to the first ids (a draft's) gives those ids and the stop ids the full
    head's logits and every other id -inf, tied or untied, float or quantized."""
    loaded = replace(pair.loaded, quantization=quantization)
    vocab = pair.loaded.hf_config.vocab_size
    rows = vocab // 3
    stops = [1, vocab - 7, vocab - 1]  # the tiny tokenizer's own come first: put two past rows
    monkeypatch.setattr(ModelRunner, "eos_token_ids", property(lambda self: stops))
    full, limited = (
        ModelRunner(loaded, "cpu", "float32", BLOCK_SIZE, head) for head in (None, rows)
    )
    ids = pair.tokens(PROMPTS[3])
    [table] = _block_tables(1, 24, seed=6)
    logits = []
    for runner in (full, limited):
        runner.allocate_kv_cache(NUM_BLOCKS)
        logits.append(runner.forward([ForwardInput(ids, 0, table, len(ids))]))
    assert logits[1].shape == (len(ids), vocab)
    scored = torch.zeros(vocab, dtype=torch.bool)
    scored[:rows] = True
    scored[stops] = True
    _assert_close(logits[1][:, scored], logits[0][:, scored])
    assert torch.isneginf(logits[1][:, ~scored]).all()


def test_ragged_batch(pair: Pair) -> None:
    """Prefill chunks, single-token decodes and k+1 verify queries (start_pos > 0) in one pass."""
    runner = pair.runner()
    seqs = [pair.tokens(p) for p in (PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3])]
    tables = _block_tables(len(seqs), 24, seed=3)
    # Step 1: different prefill progress per request, one batch.
    first = [len(seqs[0]), 3, len(seqs[2]) - 1, 9]
    step1 = [
        ForwardInput(s[:n], 0, t, num_logits=min(2, n))
        for s, t, n in zip(seqs, tables, first, strict=True)
    ]
    out1 = runner.forward(step1)
    # Step 2: a decode, a long prefill chunk (own attention group), a single token, a verify.
    extra = [[11], None, [42], [7, 8, 9, 10]]
    step2, full = [], []
    for s, t, n, e in zip(seqs, tables, first, extra, strict=True):
        new = s[n:] if e is None else e
        full.append(s[:n] + new)
        step2.append(ForwardInput(new, n, t, num_logits=len(new)))
    assert len(step2[1].token_ids) > 16
    out2 = runner.forward(step2)
    refs = [pair.reference(f) for f in full]
    want1 = [r[n - min(2, n) : n] for r, n in zip(refs, first, strict=True)]
    want2 = [r[n:] for r, n in zip(refs, first, strict=True)]
    _assert_close(out1, torch.cat(want1))
    _assert_close(out2, torch.cat(want2))


def test_overwritten_slots_roll_back(pair: Pair) -> None:
    """A rejected draft's slot is simply overwritten by the next pass at the same position."""
    runner = pair.runner()
    ids = pair.tokens(PROMPTS[2])
    [table] = _block_tables(1, 16, seed=4)
    runner.forward([ForwardInput(ids[:-2], 0, table, 1)])
    runner.forward([ForwardInput([5, 6, 7], len(ids) - 2, table, 3)])  # rejected drafts
    logits = runner.forward([ForwardInput(ids[-2:], len(ids) - 2, table, 2)])
    _assert_close(logits, pair.reference(ids)[-2:])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_as_accurate_as_transformers(tiny_model_dir: Path, dtype: str) -> None:
    """In half precision our error against float32 is no worse than transformers' own.

    Prefill (SDPA, same rounding points) matches transformers closely; decodes and verify
    queries use the float32 short-query attention, so they round differently but not worse.
    """
    loaded = load_model(str(tiny_model_dir))
    ids = list(loaded.tokenizer(PROMPTS[0] + PROMPTS[3])["input_ids"])
    runner = ModelRunner(loaded, "cpu", dtype, BLOCK_SIZE)
    runner.allocate_kv_cache(64)
    table = list(range(64))[::-1]
    split = len(ids) - 6
    prefill = runner.forward([ForwardInput(ids[:split], 0, table, split)])
    verify = runner.forward([ForwardInput(ids[split : split + 4], split, table, 4)])
    last_two = (len(ids) - 2, len(ids) - 1)
    decodes = [runner.forward([ForwardInput([ids[p]], p, table, 1)]) for p in last_two]
    ours = torch.cat([prefill, verify, *decodes])
    assert ours.dtype == torch.float32
    half = _reference_logits(tiny_model_dir, ids, getattr(torch, dtype))
    gold = _reference_logits(tiny_model_dir, ids, torch.float32)
    assert (prefill - half[:split]).abs().max().item() < 0.05
    ours_err = (ours - gold).abs().max().item()
    theirs_err = (half - gold).abs().max().item()
    assert ours_err <= 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_attention_rounds_alike_in_float32_and_half_matmuls(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """On a CPU without native half-precision matmuls the short-query attention multiplies in
    float32, rounding scores and probabilities at the same points as the half-precision path:
    the two agree to within two units in the last place, whichever the host runs."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 6, 32, generator=gen).to(dtype)  # [B, Q, heads, dim]
    keys = torch.randn(2, 3, 40, 32, generator=gen).to(dtype)  # [kv_heads, B, L, dim]
    values = torch.randn(2, 3, 40, 32, generator=gen).to(dtype)
    outs = {}
    for native in (True, False):
        monkeypatch.setattr(attention, "_cpu_has_half_matmul", lambda native=native: native)
        outs[native] = attention._short_attention(q, keys, values, None, 32**-0.5)
    assert outs[False].dtype == dtype
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(outs[True], outs[False], rtol=2 * ulp, atol=2 * ulp)


def _reference_logits(path: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_cpu(tiny_model_dir: Path, dtype: str) -> None:
    loaded = load_model(str(tiny_model_dir))
    ids = list(loaded.tokenizer(PROMPTS[0])["input_ids"])
    table = list(range(32))[::-1]
    outs = []
    for device in ("cpu", "cuda"):
        runner = ModelRunner(loaded, device, dtype, BLOCK_SIZE)
        runner.allocate_kv_cache(32)
        prefill = runner.forward([ForwardInput(ids[:-3], 0, table, 2)])
        verify = runner.forward([ForwardInput(ids[-3:], len(ids) - 3, table, 3)])
        outs.append(torch.cat([prefill, verify]).cpu())
    tol = 1e-3 if dtype == "float32" else 0.25
    assert (outs[0] - outs[1]).abs().max().item() < tol


def test_runner_properties(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    runner = ModelRunner(loaded, "cpu", "bfloat16", 16)
    config = loaded.hf_config
    assert runner.vocab_size == config.vocab_size == len(loaded.tokenizer)
    assert runner.max_model_len == config.max_position_embeddings
    head_dim = config.hidden_size // config.num_attention_heads
    per_block = 2 * config.num_hidden_layers * 16 * config.num_key_value_heads * head_dim * 2
    assert runner.kv_bytes_per_block == per_block
    vocab = loaded.tokenizer.get_vocab()
    assert {vocab["<|endoftext|>"], vocab["<|im_end|>"]} <= set(runner.eos_token_ids)
    with pytest.raises(RuntimeError):
        runner.forward([ForwardInput([1], 0, [0], 1)])
    runner.allocate_kv_cache(4)
    with pytest.raises(ValueError, match="block table"):
        runner.forward([ForwardInput([1] * 17, 0, [0], 1)])
    with pytest.raises(ValueError, match="num_logits"):
        runner.forward([ForwardInput([1], 0, [0], 2)])


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen2ForCausalLM"):
        load_model(str(tmp_path))


def test_missing_model_path() -> None:
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/model.gguf")
