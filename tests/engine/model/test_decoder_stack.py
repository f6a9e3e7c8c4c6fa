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
from engine.kernels import gguf_ops
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
