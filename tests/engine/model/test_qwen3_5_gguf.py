"""The hybrid Qwen3.5 from a GGUF file (llama.cpp's `qwen35`): a tiny random Qwen3.5 with more v
heads than k heads (so the converter reorders them) written as llama.cpp's converter writes it,
in F32 and Q8_0; loaded with `quantization` none (dequantized exactly) and gguf (the file's
blocks), against transformers' Qwen3.5 holding the weights as gguf's own reader dequantizes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from engine_utils import hf_model
from family_utils import assert_greedy_equals_transformers, max_diff, prompt_ids
from gguf import GGMLQuantizationType as T
from gguf_blocks import rounded_reference
from gguf_qwen35 import CONVERTERS, qwen35_reference, run_converter, write_qwen35_gguf
from safetensors.torch import load_file
from tiny import CHAT_TEMPLATE, make_tiny_qwen3_5
from transformers import DynamicCache

from engine.kernels import gguf_ops
from engine.model.hybrid import HybridDecoderModel
from engine.model.linear_attention import GatedDeltaNet
from engine.model.loader import load_model
from engine.model.quant import native
from engine.model.quant.linear import QuantLinear
from engine.model.runner import ForwardInput, ModelRunner

BLOCKS = 64
TABLE = list(range(BLOCKS - 1, -1, -1))  # shuffled: positions never in consecutive blocks
SIZES = (7, 1, 4, 70, 1, 3)  # prompt chunks: the chunked rule, single tokens, a partial chunk
# transformers' chunked rule differences large cumulative decays: float32 rounding elsewhere shows
# up ~10x (its two forms differ by 1.6e-3; the reference's own safetensors here reach 1.1e-3)
ATOL = 2e-3
needs_kernels = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen35-src"), seed=2)


@pytest.fixture(scope="module", params=[T.F32, T.Q8_0], ids=["F32", "Q8_0"])
def gguf_file(request: pytest.FixtureRequest, src: Path, private_cache: None) -> Path:
    path = src.parent / f"qwen35-{request.param.name}.gguf"
    if not path.exists():
        write_qwen35_gguf(path, src, request.param)
        qwen35_reference(path, src, _ref(path))
    return path


def _ref(path: Path) -> Path:
    return path.with_name(f"{path.stem}-ref")


def _dense(quantization: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GGUF matrices multiplied dense (blocks dequantized exactly) rather than by the native
    kernel, which rounds activations to int8 (that path: its own tests)."""
    if quantization == "gguf":
        if not gguf_ops.available():
            pytest.skip("native kernels not built")
        monkeypatch.setattr(native.GgufKernel, "native", native.GgufKernel.dense)


@pytest.mark.skipif(not CONVERTERS, reason="llama.cpp's converter not unpacked (make llama-server)")
@pytest.mark.parametrize("kind", [T.F32, T.Q8_0], ids=["F32", "Q8_0"])
def test_the_files_are_llama_cpp_converter_files(kind: T, src: Path, tmp_path: Path) -> None:
    """Every tensor (name, type, bytes) and every architecture key as the converter writes them."""
    ours = gguf.GGUFReader(str(write_qwen35_gguf(tmp_path / "ours.gguf", src, kind)))
    theirs = gguf.GGUFReader(str(run_converter(src, tmp_path / "theirs.gguf", kind)))
    assert {t.name for t in ours.tensors} == {t.name for t in theirs.tensors}
    by_name = {t.name: t for t in theirs.tensors}
    for t in ours.tensors:
        assert t.tensor_type == by_name[t.name].tensor_type, t.name
        assert bytes(t.data.tobytes()) == bytes(by_name[t.name].data.tobytes()), t.name
    keys = [k for k in ours.fields if k.startswith("qwen35.")]
    assert keys and set(keys) == {k for k in theirs.fields if k.startswith("qwen35.")}
    for k in keys:
        assert ours.fields[k].contents() == theirs.fields[k].contents(), k


def test_the_reference_undoes_the_converter(src: Path, gguf_file: Path) -> None:
    """On the F32 file the reference gets the checkpoint back, but for the rounding of the
    converter's 1 + w (norms) and of log(-(-exp(A_log))): so the references hold the file's
    values in transformers' layout."""
    if not gguf_file.name.endswith("F32.gguf"):
        pytest.skip("quantized values differ from the checkpoint's")
    want = load_file(str(src / "model.safetensors"))
    got = load_file(str(_ref(gguf_file) / "model.safetensors"))
    for name, value in want.items():
        if name.endswith("norm.weight") and "linear_attn" not in name:
            value = (value + 1) - 1  # float32, as stored and read back
        if name.endswith("A_log"):
            assert torch.allclose(got[name], value, rtol=1e-6, atol=1e-6), name
        else:
            assert torch.equal(got[name], value), name


def test_config_and_tokenizer_are_read_from_the_file(gguf_file: Path, src: Path) -> None:
    loaded = load_model(str(gguf_file), "none")
    config, want = loaded.hf_config, json.loads((src / "config.json").read_text())
    assert loaded.architecture == "Qwen3_5ForCausalLM"
    for key in (
        "layer_types",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "head_dim",
        "num_key_value_heads",
        "intermediate_size",
        "tie_word_embeddings",
        "vocab_size",
    ):
        assert getattr(config, key) == want[key], key
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert config.linear_value_heads_tiled  # the converter's v-head order, kept
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer("a b").input_ids == hf_tokenizer_ids(src, "a b")


def hf_tokenizer_ids(src: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(src))(text).input_ids)


def _runner(path: Path, quantization: str) -> ModelRunner:
    runner = ModelRunner(load_model(str(path), quantization), "cpu", "float32", 4)  # type: ignore[arg-type]
    runner.allocate_kv_cache(BLOCKS)
    runner.allocate_states(2)
    return runner


@torch.no_grad()
def _hf_chunked_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers over the same chunks with its cache (chunked rule, stepped for one token)."""
    model = hf_model(model_dir)
    cache, outs, pos = DynamicCache(config=model.config), [], 0
    for size in SIZES:
        outs.append(
            model(torch.tensor([ids[pos : pos + size]]), cache=cache, use_cache=True).logits[0]
        )
        pos += size
    return torch.cat(outs)


def _chunked_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    outs, pos = [], 0
    for size in SIZES:
        chunk = ids[pos : pos + size]
        outs.append(runner.forward([ForwardInput(chunk, pos, TABLE, size, state_slot=1)]))
        pos += size
    return torch.cat(outs)


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_logits_match_transformers_on_the_dequantized_weights(
    quantization: str, gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three prompts in chunks of SIZES, each from position 0 in a reused slot: within 2e-4 of
    the same chunks on the reference's safetensors (the file read right, tiled v heads and all:
    their other head order sums in another order, 1.04e-4 apart at most seen, with torch's eager
    ops where the native ones are off), and within the chunked rule's float32 spread of
    transformers."""
    _dense(quantization, monkeypatch)
    runner = _runner(gguf_file, quantization)
    model = runner.model
    assert isinstance(model, HybridDecoderModel)
    layer = model.layers[0].linear_attn
    assert isinstance(layer, GatedDeltaNet) and layer.shape.tiled_v_heads
    if quantization == "gguf" and gguf_file.name.endswith("Q8_0.gguf"):
        for proj in (layer.in_proj_qkv, layer.in_proj_a, layer.out_proj):
            assert isinstance(proj, QuantLinear) and proj.formats == ["Q8_0"]
    ref = _ref(gguf_file)
    if quantization == "none":  # converted to bfloat16 safetensors: the reference rounded so
        ref = rounded_reference(ref)
    from_ref = _runner(ref, "none")
    for seed in (1, 2, 3):
        ids = prompt_ids(sum(SIZES), seed)
        ours = _chunked_logits(runner, ids)
        assert max_diff(ours, _chunked_logits(from_ref, ids)) < 2e-4
        assert max_diff(ours, _hf_chunked_logits(ref, ids)) < ATOL


@pytest.mark.parametrize("kind", ["none", "ngram"])
def test_greedy_equals_transformers(
    kind: str, gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six requests batched, prompts in chunks of at most 9 tokens, plain and with n-gram drafts
    (rejections roll each request's recurrent state back), on the file's blocks."""
    _dense("gguf", monkeypatch)
    ref = _ref(gguf_file)
    assert_greedy_equals_transformers(kind, gguf_file, ref, reference=ref, quantization="gguf")


@needs_kernels
def test_native_speculative_greedy_equals_plain_greedy(gguf_file: Path) -> None:
    """On the native kernels (activations rounded to int8: not transformers' numbers), the text
    with n-gram drafts is plain greedy's."""
    from engine_utils import greedy, make_engine, outputs
    from family_utils import batched_prompts

    from engine.config import SpeculativeConfig

    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    want = outputs(
        make_engine(gguf_file, quantization="gguf", max_num_batched_tokens=9),
        batched_prompts(),
        greedy(12),
    )
    engine = make_engine(
        gguf_file, quantization="gguf", max_num_batched_tokens=9, speculative=ngram
    )
    assert outputs(engine, batched_prompts(), greedy(12)) == want
