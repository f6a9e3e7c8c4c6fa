"""`quantization: gguf`: a GGUF file's blocks kept as stored and run by the native kernels, in a
tiny model end to end; speculation equal to plain decoding; `auto` resolving to it; the fallback
without the kernels."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, make_engine, outputs, random_prompts
from gguf import GGMLQuantizationType as T
from gguf_blocks import random_blocks, write_random_gguf
from tiny import make_tiny_model

from engine.config import SpeculativeConfig
from engine.kernels import gguf_ops
from engine.model.loader import load_model
from engine.model.quant import native
from engine.model.quant.formats import GgufBlocks
from engine.model.quant.linear import QuantEmbedding, QuantLinear
from engine.model.runner import ForwardInput, ModelRunner

needs_kernels = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")
KINDS = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gguf")
    src = make_tiny_model(
        tmp / "src", hidden_size=256, intermediate_size=512, tie_word_embeddings=request.param
    )
    path = tmp / "tiny.gguf"
    write_random_gguf(path, src, KINDS)
    return path


def _logits(
    path: Path, quantization: str, dtype: str, ids: list[int]
) -> tuple[ModelRunner, torch.Tensor]:
    runner = ModelRunner(load_model(str(path), quantization), "cpu", dtype, 4)  # type: ignore[arg-type]
    runner.allocate_kv_cache(32)
    return runner, runner.forward([ForwardInput(ids, 0, list(range(32)), len(ids))])


@needs_kernels
def test_gguf_keeps_the_blocks_and_every_matrix_is_within_rounding_of_its_float_path(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each matrix of a forward against the same blocks dequantized exactly with float32
    activations: only the int8 activation rounding differs, ~0.7% for Gaussian rows
    (amax / 127 / sqrt(12) per value over amax / rms ~ 3-4), ~1.3% with the outliers seen here.
    The random weights amplify that over two layers (their logits are nearly flat, so argmax
    agreement says little), so the logits get a looser bound."""
    errors: list[float] = []
    native_call = native.GgufKernel.native

    def checked(self: native.GgufKernel, x: torch.Tensor) -> torch.Tensor:
        got, want = native_call(self, x), self.dense(x)
        errors.append(((got - want).norm() / want.norm()).item())
        return got

    ids = list(range(3, 30))
    monkeypatch.setattr(native.GgufKernel, "native", checked)
    runner, ours = _logits(tiny_gguf, "gguf", "float32", ids)
    for kind in ("Q4_K", "Q6_K", "Q8_0", "Q5_0"):
        assert kind in runner.weights.label
    embedding = runner.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and embedding.table is not None
    tied = embedding.head is not None
    assert (embedding.table.blocks is not None) == tied  # untied: rows looked up in the file
    assert len(errors) >= 2 * 4 + 1 and 0 < max(errors) < 0.02
    monkeypatch.setitem(native._dense_from, torch.float32, 0)  # every call dense
    _, reference = _logits(tiny_gguf, "gguf", "float32", ids)
    assert ((ours - reference).norm() / reference.norm()).item() < 0.15


@needs_kernels
def test_speculative_greedy_equals_plain(tiny_gguf: Path, tiny_draft_dir: Path) -> None:
    """The verify rows go through the same kernel as a decode row, bit for bit."""
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=3, adaptive=False, draft_model=str(tiny_draft_dir)
    )
    plain = make_engine(tiny_gguf, quantization="gguf", dtype="bfloat16")
    speculative = make_engine(tiny_gguf, quantization="gguf", dtype="bfloat16", speculative=spec)
    assert "Q4_K" in speculative.target.weights.label
    prompts = random_prompts(4, (3, 20), 300, seed=5)
    params = greedy(10)
    assert outputs(speculative, prompts, params) == outputs(plain, prompts, params)


def _native_share(runner: ModelRunner) -> tuple[int, int]:
    """(linear layers whose every kernel is the native GGUF one, linear layers)."""
    linears = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    native_ones = [m for m in linears if all(isinstance(k, native.GgufKernel) for k in m.kernels)]
    return len(native_ones), len(linears)


def _auto_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "quantization auto" in r.getMessage()]


@needs_kernels
def test_auto_on_a_gguf_file_is_the_native_path_for_target_and_draft(
    tiny_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine's default, `auto`, runs a GGUF's blocks on the native kernels, and a draft
    without its own setting follows the same rule."""
    assert load_model(str(tiny_gguf), "auto").quantization == "gguf"
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=2, adaptive=False, draft_model=str(tiny_gguf)
    )
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specserve.quant"):
        engine = make_engine(tiny_gguf, speculative=spec)
    assert engine.config.quantization == "auto" and engine.config.draft_quantization == "auto"
    for runner in (engine.target, engine.draft):
        assert runner is not None
        native_ones, linears = _native_share(runner)
        assert linears > 0 and native_ones == linears
        assert "Q4_K" in runner.weights.label
    lines = _auto_lines(caplog)
    assert len(lines) == 2 and all(line.endswith("native kernels (gguf)") for line in lines)


def test_without_the_kernels_auto_runs_the_blocks_on_torch_kernels(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the kernels do not load, `auto` is what it was before them: the file's blocks read
    raw into torch's int4/int8 kernels."""
    monkeypatch.setattr(gguf_ops, "available", lambda: False)
    with caplog.at_level(logging.INFO, logger="specserve.quant"):
        loaded = load_model(str(tiny_gguf), "auto")
    assert loaded.quantization == "auto" and loaded.gguf_file == tiny_gguf
    runner = ModelRunner(loaded, "cpu", "bfloat16", 4)
    assert _native_share(runner)[0] == 0
    assert "Q4_K" not in runner.weights.label and "int4-g32" in runner.weights.label
    lines = _auto_lines(caplog)
    assert len(lines) == 1 and "torch's int4/int8 kernels" in lines[0]


def test_without_the_kernels_gguf_runs_as_auto_with_one_line(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gguf_ops, "available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="specserve.quant"):
        runner, _ = _logits(tiny_gguf, "gguf", "bfloat16", [3, 4, 5])
    assert "Q4_K" not in runner.weights.label and "int4-g32" in runner.weights.label
    lines = [r.getMessage() for r in caplog.records if "quantization gguf" in r.getMessage()]
    assert len(lines) == 1 and "not available" in lines[0]


def test_gguf_on_a_float_checkpoint_runs_as_auto(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="specserve.quant"):
        loaded = load_model(str(tiny_model_dir), "gguf")
        runner = ModelRunner(loaded, "cpu", "float32", 4)
    assert loaded.quantization == "none" and runner.weights.label == "float32"
    assert any("not a .gguf file" in r.getMessage() for r in caplog.records)
    assert load_model(str(tiny_model_dir), "auto").quantization == "none"


@needs_kernels
def test_prefill_path_is_measured_and_both_paths_agree(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up timing picks a row count (or none) and says so; the dense path computes
    the same product without the activation rounding."""
    monkeypatch.setattr(native, "_dense_from", {})
    monkeypatch.setattr(native, "_MEASURE_MIN_VALUES", 0)
    monkeypatch.setattr(native, "PREFILL_CANDIDATES", (32,))
    weight = GgufBlocks(random_blocks(T.Q4_K, 64, 512), int(T.Q4_K), 512, "Q4_K")
    with caplog.at_level(logging.INFO, logger="specserve.quant"):
        kernel = native.GgufKernel(weight, torch.bfloat16)
    assert native._dense_from[torch.bfloat16] in (32, native.NEVER)
    assert any("gguf kernels" in r.getMessage() for r in caplog.records)
    x = torch.randn(40, 512)
    want = x @ weight.dequantize().T
    for path in (kernel.native, kernel.dense):
        assert ((path(x) - want).norm() / want.norm()).item() < 0.02


@needs_kernels
def test_a_short_request_runs_native_beside_a_long_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense prefill path is chosen per request chunk, not per call: a decode row batched
    with a long prompt chunk gets the native result it gets alone (bit for bit), while the
    chunk's rows run dense; logits rows (not the forward's tokens) run native."""
    monkeypatch.setitem(native._dense_from, torch.bfloat16, 8)
    weight = GgufBlocks(random_blocks(T.Q4_K, 32, 256), int(T.Q4_K), 256, "Q4_K")
    kernel = native.GgufKernel(weight, torch.bfloat16)
    x = torch.randn(13, 256)
    with native.forward_chunks([1, 12]):
        mixed = kernel(x)
        logits_rows = kernel(x[:9])
    assert torch.equal(mixed[:1], kernel.native(x[:1]))
    assert torch.equal(mixed[1:], kernel.dense(x[1:]).float())
    assert torch.equal(logits_rows, kernel.native(x[:9]))
    assert torch.equal(kernel(x), kernel.dense(x))  # outside a forward: one chunk


@needs_kernels
def test_speculative_greedy_equals_plain_across_prompt_lengths(
    tiny_gguf: Path, tiny_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16, prompts on both sides of the short-query limit and of the dense prefill path
    (forced low here), concurrent requests: drafts never move a row to another kernel."""
    monkeypatch.setitem(native._dense_from, torch.bfloat16, 20)
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=4, adaptive=False, draft_model=str(tiny_draft_dir)
    )
    plain = make_engine(tiny_gguf, quantization="gguf", dtype="bfloat16")
    speculative = make_engine(tiny_gguf, quantization="gguf", dtype="bfloat16", speculative=spec)
    prompts = random_prompts(6, (10, 45), 300, seed=8)
    params = greedy(12)
    assert outputs(speculative, prompts, params) == outputs(plain, prompts, params)


@needs_kernels
def test_bf16_prefill_gemm_agrees_with_the_dequantized_linear(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 model's prompt chunk through the native bf16 dequantization against the former
    dense path (float32 dequantization, then `.to(bfloat16)`): the weights differ by at most one
    bf16 step where an FMA rounds once, so the logits stay within bf16 noise."""
    if not gguf_ops.has_prefill_ops():
        pytest.skip("the prefill ops are not in the library")
    monkeypatch.setitem(native._dense_from, torch.bfloat16, 17)  # prompt chunks dense
    ids = list(range(3, 60))
    _, ours = _logits(tiny_gguf, "gguf", "bfloat16", ids)
    monkeypatch.setattr(gguf_ops, "has_prefill_ops", lambda: False)
    _, former = _logits(tiny_gguf, "gguf", "bfloat16", ids)
    assert ((ours - former).norm() / former.norm()).item() < 0.02


@needs_kernels
def test_bf16_prefill_gemm_with_chunks_and_prefix_cache(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts chunked (17-row chunks run dense) and a second round served from the prefix cache
    give the tokens that one unchunked, uncached run gives, every row through the dense path."""
    if not gguf_ops.has_prefill_ops():
        pytest.skip("the prefill ops are not in the library")
    monkeypatch.setitem(native._dense_from, torch.bfloat16, 0)  # every row dense: one kernel
    prompts = random_prompts(3, (30, 60), 300, seed=7)
    whole = make_engine(tiny_gguf, quantization="gguf", dtype="bfloat16")
    want = outputs(whole, prompts, greedy(6))
    chunked = make_engine(
        tiny_gguf, quantization="gguf", dtype="bfloat16", max_num_batched_tokens=17,
        enable_prefix_caching=True,
    )  # fmt: skip
    assert outputs(chunked, prompts, greedy(6)) == want
    assert outputs(chunked, prompts, greedy(6)) == want  # the second time from the prefix cache
