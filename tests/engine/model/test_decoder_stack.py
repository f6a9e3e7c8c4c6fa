"""The native layer stack (engine/model/decoder_stack.py, csrc/layers.cpp) against the Python
layer loop it replaces for decode and verify forwards: the same logits and the same K/V writes
bit for bit, in float32 and bfloat16; used by the engine where it applies and nowhere else."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, make_engine, outputs, random_prompts
from gguf import GGMLQuantizationType as T
from gguf_blocks import write_random_gguf
from tiny import make_tiny_model

from engine.config import SpeculativeConfig
from engine.kernels import attention_ops, gguf_ops
from engine.model import decoder_stack
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

pytestmark = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")
# q, k and v in different formats: a qkv of three kernels; Q6_K and Q5_0 elsewhere
KINDS = [T.Q4_K, T.Q8_0, T.Q6_K, T.Q5_0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("stack")
    src = make_tiny_model(tmp / "src", hidden_size=256, intermediate_size=512, num_layers=3)
    path = tmp / "tiny.gguf"
    write_random_gguf(path, src, KINDS)
    return path


def _runner(path: Path, dtype: str, block_size: int = 16) -> ModelRunner:
    runner = ModelRunner(load_model(str(path), "gguf"), "cpu", dtype, block_size)  # type: ignore[arg-type]
    runner.allocate_kv_cache(64)
    return runner


def _both_ways(
    runner: ModelRunner, inputs: list[ForwardInput]
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """(logits, caches) from the Python loop, then from the native stack, each from the same
    cache state."""
    stack = runner.model.native_stack
    before = [c.clone() for kv in runner.kv_caches for c in kv]

    def run(native: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for cache, saved in zip([c for kv in runner.kv_caches for c in kv], before, strict=True):
            cache.copy_(saved)
        runner.model.native_stack = stack if native else None
        logits = runner.forward(inputs)
        return logits, [c.clone() for kv in runner.kv_caches for c in kv]

    python_logits, python_caches = run(False)
    native_logits, native_caches = run(True)
    return python_logits, python_caches, native_logits, native_caches


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_python_loop_for_decodes_and_verify_queries(
    tiny_gguf: Path, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="specserve.engine"):
        runner = _runner(tiny_gguf, dtype)
    assert runner.model.native_stack is not None
    assert any("3 layers in one native call" in r.getMessage() for r in caplog.records)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 300, (40,), generator=gen).tolist()
    runner.forward([ForwardInput(prompt, 0, [0, 1, 2, 3], 1)])  # a prompt: the Python loop
    cases = [
        [ForwardInput([7], 40, [0, 1, 2, 3], 1)],  # one decode
        [ForwardInput([7, 8, 9, 10, 11], 40, [0, 1, 2, 3], 5)],  # a verify query of 5
        [  # a batch: decode, verify, and a request at a block boundary
            ForwardInput([7], 40, [0, 1, 2, 3], 1),
            ForwardInput([5, 6, 7], 15, [4, 5], 3),
            ForwardInput([9, 10], 31, [6, 7, 8], 2),
        ],
    ]
    for inputs in cases:
        python_logits, python_caches, native_logits, native_caches = _both_ways(runner, inputs)
        assert torch.equal(python_logits, native_logits)
        assert all(torch.equal(a, b) for a, b in zip(python_caches, native_caches, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_keeps_an_eagle3_heads_streams_as_the_python_loop(
    tiny_gguf: Path, dtype: str
) -> None:
    """With aux layers asked for (an EAGLE-3 head's features: layer 0's input, a middle one's,
    the last output before the norm) decodes and verifies still take the native stack, and the
    streams it keeps equal the Python loop's bit for bit."""
    runner = ModelRunner(load_model(str(tiny_gguf), "gguf"), "cpu", dtype, 16)  # type: ignore[arg-type]
    runner.keep_aux_hidden((0, 1, 3))
    runner.allocate_kv_cache(64)
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runner.forward([ForwardInput(prompt, 0, [0, 1, 2, 3], 1)])
    verify = [ForwardInput([7, 8, 9, 10, 11], 40, [0, 1, 2, 3], 5)]
    python_logits, _, native_logits, _ = _both_ways(runner, verify)  # the native run last
    assert torch.equal(python_logits, native_logits)
    stack = runner.model.native_stack
    assert stack is not None and stack.aux_layers == (0, 1, 3)  # it ran, keeping the streams
    native = runner.aux_hidden([0, 1, 2, 3], 40, 45).clone()  # [5, 3 * hidden]
    runner.model.native_stack = None
    runner.forward(verify)  # the Python loop, over the same cache state
    assert native.shape == (5, 3 * 256)
    assert torch.equal(runner.aux_hidden([0, 1, 2, 3], 40, 45), native)


def test_prompt_chunks_keep_the_python_loop(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = _runner(tiny_gguf, "float32")
    calls: list[int] = []
    stack = runner.model.native_stack
    assert stack is not None
    forward = stack.stack.forward

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return forward(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(stack, "stack", type("Wrapped", (), {"forward": staticmethod(counted)}))
    runner.forward([ForwardInput(list(range(3, 43)), 0, [0, 1, 2], 1)])  # 40 > 16 query tokens
    assert calls == []
    runner.forward([ForwardInput([5], 40, [0, 1, 2], 1)])
    assert calls == [1]


def test_engine_output_with_and_without_the_stack(
    tiny_gguf: Path, tiny_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain and speculative greedy output equal with the stack on, and equal to the Python
    loop's (the draft, a float checkpoint, keeps the Python loop)."""
    prompts = random_prompts(4, (5, 30), 300, seed=3)
    engine = make_engine(tiny_gguf, quantization="gguf", dtype="bfloat16", block_size=16)
    assert engine.target.model.native_stack is not None
    with_stack = outputs(engine, prompts, greedy(12))
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=3, adaptive=False, draft_model=str(tiny_draft_dir)
    )
    speculative = make_engine(
        tiny_gguf, quantization="gguf", dtype="bfloat16", block_size=16, speculative=spec
    )
    assert outputs(speculative, prompts, greedy(12)) == with_stack
    monkeypatch.setattr(decoder_stack, "ENABLED", False)
    assert outputs(engine, prompts, greedy(12)) == with_stack


def test_no_stack_where_a_linear_layer_is_not_gguf(tiny_model_dir: Path) -> None:
    runner = ModelRunner(load_model(str(tiny_model_dir), "none"), "cpu", "float32", 16)
    assert runner.model.native_stack is None


def _count_stack_calls(stack: decoder_stack.NativeStack, calls: list[bool]) -> None:
    """Record each native call, True where it carried a draft tree's bits (its last argument)."""
    forward = stack.stack.forward

    def counted(*args: object) -> torch.Tensor:
        calls.append(args[-1] is not None)
        return forward(*args)  # type: ignore[no-any-return]

    stack.stack = type("Wrapped", (), {"forward": staticmethod(counted)})  # type: ignore[assignment]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_python_loop_for_a_tree_verify(
    tiny_gguf: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draft tree's verify (two branches, beside a chain verify and a decode) takes the native
    stack, its rows' ancestors as the kernel's tree bits, bit for bit the Python loop's, whose
    attention takes the native kernel with the same bits."""
    runner = _runner(tiny_gguf, dtype)
    stack = runner.model.native_stack
    assert stack is not None
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runner.forward([ForwardInput(prompt, 0, [0, 1, 2, 3], 1)])
    runner.forward([ForwardInput(prompt[:20], 0, [4, 5], 0)])
    inputs = [
        ForwardInput([7, 8, 9, 10, 11, 12, 13], 40, [0, 1, 2, 3], 7, 6, (-1, 0, 1, -1, 3, 0)),
        ForwardInput([5, 6, 7], 20, [4, 5], 3, 2),
        ForwardInput([9], 39, [6, 7, 8], 1),
    ]
    runner.forward([ForwardInput(prompt[:39], 0, [6, 7, 8], 0)])
    calls: list[bool] = []
    _count_stack_calls(stack, calls)
    kernel_bits: list[bool] = []
    paged = attention_ops.paged_attention

    def counted_kernel(*args: object, **kw: object) -> torch.Tensor:
        kernel_bits.append(kw.get("tree_bits") is not None)
        return paged(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_ops, "paged_attention", counted_kernel)
    python_logits, python_caches, native_logits, native_caches = _both_ways(runner, inputs)
    assert kernel_bits == [True] * 3  # the Python loop: the kernel with bits in each layer
    assert calls == [True]  # then the native stack, once, with them
    assert torch.equal(python_logits, native_logits)
    assert all(torch.equal(a, b) for a, b in zip(python_caches, native_caches, strict=True))
    # the first path's rows (at their own positions) are the chain verify's of that path
    chain = runner.forward([ForwardInput([7, 8, 9, 10], 40, [0, 1, 2, 3], 4, 3)])
    assert calls == [True, False]
    assert torch.equal(native_logits[:4], chain)


def _ambiguous_prompts(n: int, seed: int = 5) -> list[list[int]]:
    """Text over a few tokens, so each n-gram recurs with different continuations (trees)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        alphabet = torch.randperm(290, generator=gen)[:4] + 3
        picks = torch.randint(0, 4, (20 + 5 * i,), generator=gen)
        prompts.append(alphabet[picks].tolist())
    return prompts


def test_engine_greedy_under_trees_on_the_native_stack(tiny_gguf: Path) -> None:
    """n-gram trees on the GGUF target in bfloat16: the greedy text is plain decoding's, and
    the tree verifies run the one-call native stack with their bits."""
    prompts = _ambiguous_prompts(4)
    plain = make_engine(tiny_gguf, quantization="gguf", dtype="bfloat16", block_size=16)
    reference = outputs(plain, prompts, greedy(16))
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=6, ngram_min=1, ngram_max=3, adaptive=False,
        tree_width=3,
    )  # fmt: skip
    engine = make_engine(
        tiny_gguf, quantization="gguf", dtype="bfloat16", block_size=16, speculative=spec
    )
    stack = engine.target.model.native_stack
    assert stack is not None
    calls: list[bool] = []
    _count_stack_calls(stack, calls)
    seqs = engine.generate(prompts, greedy(16))
    assert [s.output_token_ids for s in seqs] == reference
    assert sum(calls) > 0  # tree verifies took the stack
    assert sum(s.spec.num_accepted_tokens for s in seqs) > 0
