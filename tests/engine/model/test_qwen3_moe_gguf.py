"""Qwen3-MoE from a GGUF file: a tiny random Qwen3-MoE written as llama.cpp's converter writes it
(stacked `ffn_{gate,up,down}_exps` expert tensors, the router `ffn_gate_inp` in F32, the experts'
width in `expert_feed_forward_length`), experts in Q8_0, loaded with `quantization` none (converted
by transformers' own reader) and gguf (each expert's blocks cut out of the stacked tensor, on the
native kernels), against transformers' Qwen3-MoE holding the dequantized weights."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_utils import greedy, hf_greedy, make_engine, outputs, random_prompts
from family_utils import file_logits, hf_logits, prompt_ids
from gguf import GGMLQuantizationType as T
from gguf_blocks import _SCALE_OFFSETS, finish, random_blocks, rounded_reference, save_reference
from safetensors.torch import load_file
from tiny import _gguf_hparams, _gguf_tokenizer, make_tiny_model

from engine.config import SpeculativeConfig
from engine.kernels import gguf_ops
from engine.model import decoder_stack
from engine.model.loader import load_model
from engine.model.moe import MoE
from engine.model.quant import native, native_experts
from engine.model.quant.linear import QuantLinear
from engine.model.runner import ModelRunner

QWEN3_MOE = dict(
    family="qwen3_moe",
    num_layers=2,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,  # llama.cpp's qwen3moe always renormalizes
    tie_word_embeddings=False,
)
ATOL = 1e-4
MAX_TOKENS = 12
needs_kernels = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")


def _quantized(array: np.ndarray, kind: T) -> tuple[np.ndarray, np.ndarray, T | None]:
    """(the file's data, the values gguf's own reader gives back, the raw type to write) for a
    matrix in `kind`; vectors stay F32."""
    if kind == T.F32 or array.ndim == 1:
        return array, array, None
    if kind in _SCALE_OFFSETS:  # K-quants: gguf has no quantizer for them; random blocks
        rows = int(np.prod(array.shape[:-1]))
        blocks = random_blocks(kind, rows, array.shape[-1], seed=rows, low=1e-4).numpy()
        data = blocks.reshape(*array.shape[:-1], -1)
        return data, np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32), kind
    data = gguf.quants.quantize(array, kind)
    return data, np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32), kind


def write_qwen3_moe_gguf(path: Path, src: Path, kind: T) -> Path:
    """`src` as a GGUF in llama.cpp's layout, matrices in `kind`, router and norms in F32; and
    beside it (`<path>-ref`) the same model as safetensors holding the dequantized values."""
    config = json.loads((src / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config["num_local_experts"]
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    _gguf_hparams(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    _gguf_tokenizer(writer, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, layers)
    tensors, ref = load_file(str(src / "model.safetensors")), {}
    for name, tensor in sorted(tensors.items()):
        if ".experts." in name:
            continue
        base, suffix = name.rsplit(".", 1)
        router = name.endswith("mlp.gate.weight")
        data, ref[name], raw = _quantized(tensor.float().numpy(), T.F32 if router else kind)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", data, raw_dtype=raw)
    for i in range(layers):
        for part in ("gate_proj", "up_proj", "down_proj"):
            hf = [f"model.layers.{i}.mlp.experts.{e}.{part}.weight" for e in range(experts)]
            stacked = np.stack([tensors[n].float().numpy() for n in hf])  # [E, rows, cols]
            data, values, raw = _quantized(stacked, kind)
            ref |= {n: values[e] for e, n in enumerate(hf)}
            target = names.get_name(f"model.layers.{i}.mlp.experts.{part}")
            writer.add_tensor(f"{target}.weight", data, raw_dtype=raw)
    finish(writer)
    save_reference(src, path.with_name(f"{path.stem}-ref"), ref)
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3-moe-src"), seed=5, **QWEN3_MOE)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=[T.F32, T.Q8_0], ids=["F32", "Q8_0"])
def gguf_file(request: pytest.FixtureRequest, src: Path, private_cache: None) -> Path:
    path = src.parent / f"qwen3moe-{request.param.name}.gguf"
    return path if path.exists() else write_qwen3_moe_gguf(path, src, request.param)


def _ref(path: Path, bf16: bool = False) -> Path:
    """The dequantized reference; with `bf16` rounded as `none`'s conversion by transformers'
    reader stores it: bfloat16, but the stacked experts kept in float32."""
    ref = path.with_name(f"{path.stem}-ref")
    return rounded_reference(ref, lambda name: ".experts." in name) if bf16 else ref


def _dense(quantization: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GGUF matrix multiplied dense (its blocks dequantized exactly, float32 GEMM) rather
    than by the native kernel, which rounds activations to int8 (that path, the native experts'
    call and the native stack, which call it directly: their own tests)."""
    if quantization == "gguf":
        monkeypatch.setattr(native.GgufKernel, "native", native.GgufKernel.dense)
        monkeypatch.setattr(native_experts, "build", lambda experts: None)
        monkeypatch.setattr(decoder_stack, "ENABLED", False)


def test_config_is_read_as_llama_cpp_reads_it(gguf_file: Path, src: Path) -> None:
    config = load_model(str(gguf_file), "gguf" if gguf_ops.available() else "none").hf_config
    want = json.loads((src / "config.json").read_text())
    for key in ("moe_intermediate_size", "num_local_experts", "num_experts_per_tok", "head_dim"):
        assert getattr(config, key) == want[key], key
    assert config.norm_topk_prob


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_logits_match_transformers_on_the_dequantized_weights(
    quantization: str, gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if quantization == "gguf" and not gguf_ops.available():
        pytest.skip("native kernels not built")
    _dense(quantization, monkeypatch)
    ids = prompt_ids(30, seed=1)
    runner, ours = file_logits(gguf_file, quantization, ids)
    if quantization == "gguf" and gguf_file.name.endswith("Q8_0.gguf"):
        expert = runner.model.layers[0].mlp.experts[3].gate_up_proj  # type: ignore[union-attr,index]
        assert isinstance(expert, QuantLinear) and expert.formats == ["Q8_0"]
    want = hf_logits(_ref(gguf_file, bf16=quantization == "none"), ids)
    assert (ours - want).abs().max().item() < ATOL


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_native_experts_are_batch_invariant(gguf_file: Path, dtype: torch.dtype) -> None:
    """On the native kernels a row's routed output is bit-identical alone or in any batch: the
    property that makes speculative greedy equal plain greedy."""
    if not gguf_file.name.endswith("Q8_0.gguf"):
        pytest.skip("F32 experts run dense (torch's GEMM)")
    name = str(dtype).removeprefix("torch.")
    runner = ModelRunner(load_model(str(gguf_file), "gguf"), "cpu", name, 4)
    moe = runner.model.layers[1].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(9, runner.model.shape.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = moe(x, dtype)  # rows grouped by expert
        alone = torch.cat([moe(x[i : i + 1], dtype) for i in range(9)])  # the one-row path
        pairs = torch.cat([moe(x[i : i + 2], dtype) for i in range(0, 8, 2)])
    assert torch.equal(batched, alone) and torch.equal(batched[:8], pairs)


def _prompts() -> list[list[int]]:
    repeats = [p * 3 for p in random_prompts(2, (4, 8), 300, seed=9)]  # n-gram matches
    return random_prompts(4, (3, 30), 300, seed=7) + repeats


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_greedy_equals_transformers(
    quantization: str, gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batched, prompts in chunks of at most 9 tokens, plain and with n-gram drafts."""
    if quantization == "gguf" and not gguf_ops.available():
        pytest.skip("native kernels not built")
    _dense(quantization, monkeypatch)
    ref = _ref(gguf_file, bf16=quantization == "none")
    want = [hf_greedy(ref, p, MAX_TOKENS) for p in _prompts()]
    for spec in (SpeculativeConfig(), _ngram()):
        engine = make_engine(
            gguf_file, quantization=quantization, max_num_batched_tokens=9, speculative=spec
        )
        assert outputs(engine, _prompts(), greedy(MAX_TOKENS)) == want


def _ngram() -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)


@needs_kernels
def test_native_speculative_greedy_equals_plain_greedy(gguf_file: Path) -> None:
    """On the native kernels (activations rounded to int8, so not transformers' numbers), the
    text with n-gram drafts and with the file itself as a draft is plain greedy's."""
    plain = make_engine(gguf_file, quantization="gguf", max_num_batched_tokens=9)
    want = outputs(plain, _prompts(), greedy(MAX_TOKENS))
    draft = SpeculativeConfig(
        method="draft", num_speculative_tokens=3, draft_model=str(gguf_file), adaptive=False
    )
    for spec in (_ngram(), draft):
        engine = make_engine(
            gguf_file, quantization="gguf", max_num_batched_tokens=9, speculative=spec
        )
        assert outputs(engine, _prompts(), greedy(MAX_TOKENS)) == want
