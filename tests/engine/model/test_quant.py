"""Quantized weights: formats and kernels against their dequantized reference, the raw GGUF path
(Q4_K kept as int4 exactly), tiny models quantized at load, speculation on a quantized target."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_utils import greedy, make_engine, outputs, random_prompts
from tiny import _gguf_hparams, _gguf_tokenizer, make_tiny_model

from engine.config import EngineConfig, SpeculativeConfig
from engine.kernels import gguf_ops
from engine.model.loader import load_model
from engine.model.quant import kernels
from engine.model.quant.formats import Int4Weight, Int8Weight, quantize_int4, quantize_int8
from engine.model.quant.gguf_weights import _DEQUANTIZE, q4_k_to_int4
from engine.model.quant.kernels import (
    DenseKernel,
    Int8DynamicFastKernel,
    Int8DynamicKernel,
    Int8Kernel,
    make_kernel,
)
from engine.model.quant.linear import QuantEmbedding, to_format
from engine.model.runner import ForwardInput, ModelRunner

CPU = torch.device("cpu")
# Round-to-nearest error of a Gaussian matrix, ||W_q - W|| / ||W||: int4 at group 32 and int8
# per row (measured ~0.11 and ~0.009; bounds leave room for the seed).
RTN_ERROR = {"int4": 0.13, "int8": 0.012}
needs_fbgemm = pytest.mark.skipif(
    "fbgemm" not in torch.backends.quantized.supported_engines, reason="needs fbgemm (x86)"
)


@pytest.fixture(autouse=True)
def fresh_self_tests() -> None:
    kernels._checked.clear()  # each test sees the self-test run (and log) again


def _weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def _quantize(fmt: str, w: torch.Tensor) -> Int4Weight | Int8Weight:
    return quantize_int4(w, 32) if fmt == "int4" else quantize_int8(w)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_round_to_nearest_error(fmt: str) -> None:
    w = _weight()
    assert _rel(_quantize(fmt, w).dequantize(), w) < RTN_ERROR[fmt]


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize(("rows", "n"), [(1, 96), (5, 96), (16, 96), (3, 1040)])
def test_kernel_matches_dequantized_reference(fmt: str, rows: int, n: int) -> None:
    """n = 1040: int4 weights are packed 1024 rows at a time, with a tail of 16."""
    q = _quantize(fmt, _weight(n=n))
    kernel = make_kernel(q, torch.bfloat16, CPU)
    assert not isinstance(kernel, DenseKernel), "the kernel failed its self-test on this CPU"
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = F.linear(x.float(), q.dequantize())
    assert _rel(kernel(x), want) < 1e-2  # bf16 activations and output only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_cuda_kernel_matches_dequantized_reference(fmt: str) -> None:
    cuda = torch.device("cuda")
    q = _quantize(fmt, _weight(n=128, k=1024))
    kernel = make_kernel(q, torch.bfloat16, cuda)
    x = torch.randn(5, 1024, device=cuda).to(torch.bfloat16)
    want = F.linear(x.float(), q.dequantize().to(cuda))
    # aten's int8 GEMM on CUDA is slower than bf16 on cuBLAS: int8 weights load dequantized
    assert isinstance(kernel, DenseKernel) == (fmt == "int8")
    assert _rel(kernel(x), want) < 1e-2


def test_quantization_setting_reaches_the_engine_config() -> None:
    from server.settings import Settings

    assert Settings.load(model="m").engine_config().quantization == "auto"
    assert Settings.load(model="m", quantization="int4").engine_config().quantization == "int4"
    with pytest.raises(ValueError, match="quantization"):
        Settings.load(model="m", quantization="int3")
    config = Settings.load(model="m", quantization="w8a8").engine_config()
    assert config.draft_quantization == "w8a8"  # the target's unless set
    config = Settings.load(model="m", draft_quantization="w8a8-fast").engine_config()
    assert (config.quantization, config.draft_quantization) == ("auto", "w8a8-fast")
    with pytest.raises(ValueError, match="draft_quantization"):
        Settings.load(model="m", draft_quantization="int3")
    with pytest.raises(ValueError, match="for a draft model"):
        Settings.load(model="m", quantization="w8a8-fast")
    with pytest.raises(ValueError, match="for a draft model"):
        EngineConfig(model="m", quantization="w8a8-fast")


def _outlier_rows(m: int, k: int = 256, seed: int = 1) -> torch.Tensor:
    """Activations as a decoder's are: Gaussian rows, a few channels 20-50x larger."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, 5] *= 20
    x[:, 77] *= -50
    return x.to(torch.bfloat16)


@needs_fbgemm
@pytest.mark.parametrize("kind", [Int8DynamicKernel, Int8DynamicFastKernel])
def test_w8a8_rows_are_bit_identical_in_any_batch(kind: type[Int8DynamicKernel]) -> None:
    """Verification computes a request's rows beside other rows and drafts: with int8
    activations a row must not see its neighbours, or greedy speculation would drift. The
    target's kernel holds this down to a row alone; the draft's rounds a lone row on fbgemm's
    own grid, close to but not the batch's."""
    weight = quantize_int8(_weight())
    kernel = kind(weight, CPU)
    x = _outlier_rows(12)
    x[3] *= 1000  # one row far larger than the rest would set fbgemm's scale for all
    batch = kernel(x)
    for m in (2, 5, 8, 9):
        assert torch.equal(kernel(x[:m]), batch[:m])
    want = F.linear(x.float(), weight.dequantize())
    for i in range(12):
        alone = kernel(x[i : i + 1])[0]
        if kind is Int8DynamicKernel:
            assert torch.equal(alone, batch[i])
        else:
            assert _rel(alone, want[i]) < kind.tolerance
            assert torch.equal(alone, kernel(x[i : i + 1])[0])  # and the same every time


@needs_fbgemm
def test_w8a8_two_passes_are_as_exact_as_bf16_and_one_pass_is_not() -> None:
    q = quantize_int8(_weight())
    x = _outlier_rows(6)
    want = F.linear(x.float(), q.dequantize())
    bf16 = _rel(F.linear(x, q.dequantize(torch.bfloat16)), want)
    two, one = Int8DynamicKernel(q, CPU)(x), Int8DynamicFastKernel(q, CPU)(x)
    assert _rel(two, want) < bf16  # measured 2.5e-4 against bf16's 2.3e-3
    assert bf16 < _rel(one, want) < Int8DynamicFastKernel.tolerance  # measured 3e-2


@needs_fbgemm
def test_w8a8_mode_rounds_every_matrix_to_int8_and_takes_the_fbgemm_kernel() -> None:
    w = _weight()
    int4 = quantize_int4(w, 32)
    as_int8 = to_format(int4, "w8a8")
    assert isinstance(as_int8, Int8Weight) and as_int8.source == int4.source
    assert _rel(as_int8.dequantize(), int4.dequantize()) < RTN_ERROR["int8"]
    assert isinstance(to_format(w, "w8a8-fast"), Int8Weight)
    assert isinstance(make_kernel(as_int8, torch.bfloat16, CPU, 2), Int8DynamicKernel)
    assert isinstance(make_kernel(as_int8, torch.bfloat16, CPU, 1), Int8DynamicFastKernel)
    assert isinstance(make_kernel(as_int8, torch.float32, CPU, 2), DenseKernel)


def test_w8a8_falls_back_to_the_weight_only_int8_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantized tensors are deprecated in torch: where fbgemm's ops are gone, int8 weights
    still run on an int8 kernel, not dequantized."""

    def gone(*args: Any) -> None:
        raise AttributeError("quantized::linear_prepack is not available")

    monkeypatch.setattr(Int8DynamicKernel, "__init__", gone)
    kernel = make_kernel(quantize_int8(_weight()), torch.bfloat16, CPU, 2)
    assert isinstance(kernel, Int8Kernel)


def test_float32_activations_use_the_dequantized_reference() -> None:
    q = quantize_int4(_weight(), 32)
    kernel = make_kernel(q, torch.float32, CPU)
    assert isinstance(kernel, DenseKernel)
    x = torch.randn(3, 256)
    torch.testing.assert_close(kernel(x), F.linear(x, q.dequantize()))


def _q4_k_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Random but well-formed Q4_K rows: [n, k / 256 * 144] bytes (small positive d, dmin)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    d = rng.uniform(1e-4, 4e-4, size=(len(blocks), 2)).astype(np.float16)
    blocks[:, 0:4] = d.view(np.uint8)
    return blocks.reshape(n, -1)


def test_q4_k_maps_to_int4_exactly_up_to_bf16_scale_and_zero() -> None:
    import gguf

    raw = _q4_k_blocks(32, 512, seed=3)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K))
    ours = q4_k_to_int4(torch.from_numpy(raw))
    assert ours.shape == (32, 512) and ours.group_size == 32
    # Only the bf16 rounding of scale and zero (relative 2^-9 each) separates the two.
    q = ours.q.float().view(32, 16, 32) - 8
    bound = (q.abs() * ours.scale.float()[..., None] + ours.zero.float().abs()[..., None]) * 2**-8
    assert ((ours.dequantize().view(32, 16, 32) - ref.view(32, 16, 32)).abs() <= bound).all()
    assert _rel(ours.dequantize(), ref) < 5e-3


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_0", "Q8_0"])
def test_torch_dequantizers_equal_gguf_reference(kind: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q4_K":
        raw = _q4_k_blocks(8, 512, seed=4)
    elif kind == "Q6_K":  # gguf cannot quantize to it: random blocks, a sane f16 scale at the end
        raw = np.random.default_rng(4).integers(0, 256, size=(8, 2 * 210), dtype=np.uint8)
        blocks = raw.reshape(-1, 210)
        blocks[:, 208:210] = np.full((len(blocks), 1), 1e-3, np.float16).view(np.uint8)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(4).normal(size=(8, 512)), qtype)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    got = _DEQUANTIZE[kind](torch.from_numpy(raw))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # Q4_K: same math, other order


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quant") / "tiny", hidden_size=64)


def _logits(model: str, quantization: str, dtype: str, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(load_model(model, quantization), "cpu", dtype, 4)  # type: ignore[arg-type]
    runner.allocate_kv_cache(32)
    return runner.forward([ForwardInput(ids, 0, list(range(32)), len(ids))])


@pytest.mark.parametrize("fmt", ["int4", "int8", "w8a8"])
def test_tiny_model_quantized_at_load_matches_its_float32_reference(
    fmt: str, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels are as close to float32 as bf16 F.linear on the same weights is."""
    ids = list(range(3, 40))
    kernel_run = _logits(str(tiny_dir), fmt, "bfloat16", ids)  # int4/int8 kernels
    reference = _logits(str(tiny_dir), fmt, "float32", ids)  # same weights, dequantized
    monkeypatch.setattr(kernels, "_kernel_classes", lambda *args: [])
    bf16_dense = _logits(str(tiny_dir), fmt, "bfloat16", ids)  # same weights, bf16 F.linear
    assert _rel(kernel_run, reference) < 1.5 * _rel(bf16_dense, reference) + 0.005
    assert _rel(kernel_run, reference) < 0.05


def test_quantization_auto_leaves_float_checkpoints_alone(tiny_dir: Path) -> None:
    ids = list(range(3, 20))
    torch.testing.assert_close(
        _logits(str(tiny_dir), "auto", "float32", ids),
        _logits(str(tiny_dir), "none", "float32", ids),
    )


@pytest.mark.parametrize("fmt", ["int4", "int8", "w8a8"])
def test_speculative_greedy_equals_plain_on_a_quantized_target(
    fmt: str, tiny_dir: Path, tiny_draft_dir: Path
) -> None:
    """With int8 activations too: a row's logits do not depend on the rows verified beside it."""
    spec = SpeculativeConfig(
        method="draft",
        num_speculative_tokens=3,
        adaptive=False,
        draft_model=str(tiny_draft_dir),
        draft_quantization="w8a8-fast",
    )
    plain = make_engine(tiny_dir, quantization=fmt, dtype="bfloat16")  # bf16: the kernels run
    speculative = make_engine(tiny_dir, quantization=fmt, dtype="bfloat16", speculative=spec)
    assert fmt in speculative.target.weights.label
    assert speculative.draft is not None and "w8a8-fast" in speculative.draft.weights.label
    prompts = random_prompts(4, (3, 20), 300, seed=5)
    params = greedy(10)
    assert outputs(speculative, prompts, params) == outputs(plain, prompts, params)


def test_a_failing_kernel_falls_back_to_bf16_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any) -> torch.Tensor:
        raise RuntimeError("no int4 kernel for this CPU")

    monkeypatch.setattr(kernels, "_int4_cpu_mm", broken)
    q = quantize_int4(_weight(), 32)
    x = torch.randn(2, 256).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="specserve.quant"):
        first = make_kernel(q, torch.bfloat16, CPU)
        second = make_kernel(q, torch.bfloat16, CPU)
    assert isinstance(first, DenseKernel) and isinstance(second, DenseKernel)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "int4-cpu" in lines[0] and "no int4 kernel" in lines[0]
    assert _rel(first(x), F.linear(x.float(), q.dequantize())) < 1e-2


def _q8_0_blocks(n: int, k: int, seed: int) -> np.ndarray:
    """Q8_0 rows that int8 per row holds exactly: one power-of-two scale, a 127 in every row."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, size=(n, k // 32, 32)).astype(np.int8)
    q[:, 0, 0] = 127
    d = np.full((n, k // 32, 1), 2**-6, np.float16)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(n, -1)


def _write_quantized_gguf(path: Path, src: Path) -> None:
    """The tiny model's shapes as a GGUF of random Q4_K and Q8_0 blocks (norms and biases F32)."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "qwen2")
    _gguf_hparams(writer, config)
    _gguf_tokenizer(writer, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config["num_hidden_layers"])
    for i, (name, tensor) in enumerate(sorted(load_file(str(src / "model.safetensors")).items())):
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        array = tensor.float().numpy()
        if array.ndim == 2 and i % 2 == 0 and array.shape[1] % 256 == 0:
            kind = gguf.GGMLQuantizationType.Q4_K
            writer.add_tensor(gguf_name, _q4_k_blocks(*array.shape, seed=i), raw_dtype=kind)
        elif array.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, _q8_0_blocks(*array.shape, seed=i), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_raw_blocks_match_the_dequantized_conversion(
    tied: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto without the native kernels reads Q4_K/Q8_0 blocks raw for torch's kernels; none
    converts through transformers' dequantization.

    An untied embedding stays in the file and is dequantized a few rows at a time."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_ops, "available", lambda: False)
    src = make_tiny_model(
        tmp_path / "src", hidden_size=256, intermediate_size=256, tie_word_embeddings=tied
    )
    path = tmp_path / "tiny-q.gguf"
    _write_quantized_gguf(path, src)
    raw = load_model(str(path), "auto")
    assert raw.gguf_file == path and not list(raw.weights_dir.glob("*.safetensors"))
    ids = list(range(3, 30))
    runner = ModelRunner(raw, "cpu", "float32", 4)
    runner.allocate_kv_cache(32)
    ours = runner.forward([ForwardInput(ids, 0, list(range(32)), len(ids))])
    assert runner.weights.label.startswith(("int4-g32", "int8"))
    assert "int4-g32" in runner.weights.label and "int8" in runner.weights.label
    embedding = runner.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding)
    assert (embedding.table is not None and embedding.table.gguf is not None) == (not tied)
    converted = _logits(str(path), "none", "float32", ids)  # bf16-rounded dequantized weights
    assert _rel(ours, converted) < 0.02  # bf16 roundings: Q4_K scales here, weights in `none`
    assert (ours.argmax(-1) == converted.argmax(-1)).float().mean().item() >= 0.95


def test_activation_passes_bench_switches_the_named_matrices_only(tiny_dir: Path) -> None:
    """bench.activation_passes: one pass on the named kinds of matrix changes the logits, and
    two passes everywhere gives back exactly the served model's."""
    from bench.activation_passes import dynamic_kernels, set_one_pass

    runner = ModelRunner(load_model(str(tiny_dir), "w8a8"), "cpu", "bfloat16", 4)
    runner.allocate_kv_cache(32)
    ids = list(range(3, 40))

    def logits() -> torch.Tensor:
        return runner.forward([ForwardInput(ids, 0, list(range(32)), len(ids))])

    kernels = dynamic_kernels(runner)
    assert {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} <= set(kernels)
    served = logits()
    set_one_pass(kernels, {"down_proj"})
    assert all(k.passes == 1 for k in kernels["down_proj"])
    assert all(k.passes == 2 for k in kernels["gate_up_proj"])
    assert not torch.equal(logits(), served)
    set_one_pass(kernels, set())
    torch.testing.assert_close(logits(), served, rtol=0, atol=0)
