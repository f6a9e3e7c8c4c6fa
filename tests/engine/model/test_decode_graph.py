"""The compiled decode graph (engine/model/decode_graph.py): where it runs, that it computes what the eager
layers do, that speculation stays lossless through it, and that whatever it cannot do runs
eagerly. Compiling takes tens of seconds on 2 cores, so each module builds its runners once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, make_engine, outputs, random_prompts

from engine.config import SpeculativeConfig
from engine.model.decode_graph import DecodeGraph
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

BLOCK = 16
TABLE = list(range(8))  # 128 tokens of context, blocks 0-7


# float32, float weights: the graph computes what the eager layers do, to float32's rounding.
# bf16, w8a8-fast: a draft setting with fbgemm's GEMM through the custom op (compiling is off by
# default since the fused native ops made it no faster; it stays an option). bf16
# rounds at other points in the fused graph, and the 7-bit activation grid turns some of those
# differences into whole steps: on this random tiny model the logits land 4-10% apart (an
# unrelated output is ~140% away), so close, not equal.
SETTINGS = {"float32": ("float32", "none", 1e-4), "w8a8-fast": ("bfloat16", "w8a8-fast", 0.25)}


def _runner(model_dir: Path, compiled: bool, setting: str = "float32") -> ModelRunner:
    dtype, quantization, _ = SETTINGS[setting]
    runner = ModelRunner(
        load_model(str(model_dir), quantization), "cpu", dtype, BLOCK, compile_decode=compiled
    )
    runner.allocate_kv_cache(len(TABLE) + 2)
    return runner


@pytest.fixture(scope="module", params=list(SETTINGS))
def runners(
    request: pytest.FixtureRequest, tiny_model_dir: Path
) -> tuple[ModelRunner, ModelRunner, float]:
    """(eager, compiled, tolerance) on the same weights, the compiled one warmed up."""
    eager = _runner(tiny_model_dir, False, request.param)
    compiled = _runner(tiny_model_dir, True, request.param)
    compiled.warm_up()
    return eager, compiled, SETTINGS[request.param][2]


def _graph(runner: ModelRunner) -> DecodeGraph:
    assert runner.decode_graph is not None
    return runner.decode_graph


Runners = tuple[ModelRunner, ModelRunner, float]


def _both(runners: Runners, inputs: list[ForwardInput]) -> tuple[torch.Tensor, torch.Tensor]:
    return runners[0].forward(inputs), runners[1].forward(inputs)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _prefill(runners: Runners, length: int) -> None:
    prompt = [(7 * i + 5) % 300 + 3 for i in range(length)]
    _both(runners, [ForwardInput(prompt, 0, TABLE, 1)])


def test_one_request_decodes_through_the_graph(runners: Runners) -> None:
    graph = _graph(runners[1])
    assert graph.warm and not graph.broken
    calls = graph.calls
    _prefill(runners, 40)
    assert graph.calls == calls  # a prefill runs eagerly
    # one token, a draft's catch-up of two, a verify-sized query; across a block boundary
    pos = 40
    for num_tokens in (1, 2, 4, 1, 2, 3, 1):
        ids = [(pos + j) * 11 % 300 + 3 for j in range(num_tokens)]
        want, got = _both(runners, [ForwardInput(ids, pos, TABLE, num_tokens)])
        assert _rel_err(got, want) < runners[2]
        pos += num_tokens
    assert pos > 3 * BLOCK
    assert graph.calls == calls + 7


def test_several_requests_run_eagerly(runners: Runners) -> None:
    graph = _graph(runners[1])
    _prefill(runners, 20)
    calls = graph.calls
    batch = [ForwardInput([5, 6], 20, TABLE, 2), ForwardInput([7], 20, TABLE, 1)]
    want, got = _both(runners, batch)
    assert graph.calls == calls
    assert torch.equal(got, want)  # the same eager ops, the uniform masks add zeros


def _failing(message: str) -> Callable[..., torch.Tensor]:
    def fail(*args: object) -> torch.Tensor:
        raise RuntimeError(message)

    return fail


def test_a_failed_compile_runs_eagerly_for_good(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No C++ compiler, an op inductor cannot lower: one warning, then the eager layers."""
    eager, compiled = _runner(tiny_model_dir, False), _runner(tiny_model_dir, True)
    graph = _graph(compiled)
    graph.graph = _failing("no C++ compiler")  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, "specserve.compile"):
        compiled.warm_up()
    assert graph.broken and not graph.warm
    assert "no C++ compiler" in caplog.text
    _prefill((eager, compiled, 0.0), 20)
    want, got = _both((eager, compiled, 0.0), [ForwardInput([9], 20, TABLE, 1)])
    assert torch.equal(got, want) and graph.calls == 0


def test_after_warm_up_a_batch_needing_a_new_graph_runs_eagerly(
    runners: Runners,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    graph = _graph(runners[1])
    _prefill(runners, 20)
    monkeypatch.setattr(graph, "graph", _failing("Detected recompile"))
    with caplog.at_level(logging.WARNING, "specserve.compile"):
        want, got = _both(runners, [ForwardInput([9], 20, TABLE, 1)])
    assert torch.equal(got, want)
    assert "ran eagerly" in caplog.text and not graph.broken  # the next batch tries the graph


def test_speculation_through_a_compiled_draft_is_lossless(tiny_model_dir: Path) -> None:
    """The target drafts for itself through the graph (float32): greedy output as plain decoding,
    and nearly every draft accepted (the graph's float32 sums round apart from the eager ones)."""
    spec = SpeculativeConfig(
        method="draft",
        num_speculative_tokens=3,
        adaptive=False,
        draft_model=str(tiny_model_dir),
        draft_compile=True,
    )
    engine = make_engine(tiny_model_dir, speculative=spec, block_size=BLOCK)
    plain = make_engine(tiny_model_dir, block_size=BLOCK)
    assert engine.draft is not None
    graph = _graph(engine.draft)
    assert graph.warm
    prompts = random_prompts(3, (5, 40), 300, seed=7)
    for prompt in prompts:  # one at a time: the graph serves a single request's decode
        seq = engine.generate([prompt], greedy(24))[0]
        assert seq.output_token_ids == outputs(plain, [prompt], greedy(24))[0]
        assert seq.spec.num_accepted_tokens >= 0.9 * seq.spec.num_draft_tokens > 0
    assert graph.calls > 0
    assert engine.block_manager.usage == 0.0
