"""Gemma 3 from a GGUF file, exact: a tiny random Gemma 3 written as llama.cpp's converter writes
it (norms as 1 + w, only the metadata keys it stores), in F32 and in Q8_0, loaded with
`quantization` none (converted to bfloat16 safetensors) and gguf (the file's blocks), against
transformers' Gemma 3 holding the same weights as gguf's own reader dequantizes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_greedy, make_engine, outputs, random_prompts
from family_utils import file_logits, hf_logits, prompt_ids
from gguf import GGMLQuantizationType as T
from gguf_blocks import gemma3_reference, write_gemma3_gguf
from tiny import make_tiny_model
from transformers import AutoConfig

from engine.kernels import gguf_ops
from engine.model.gguf_config import _global_rope, _layer_types
from engine.model.loader import load_model
from engine.model.quant import native

WINDOW = 8
# llama.cpp's Gemma 3: every sixth layer global; local layers at theta 10,000, unscaled; the
# attention scale head_dim's (query_pre_attn_scalar = head_dim: transformers' default is 256)
LAYER_TYPES = ["sliding_attention"] * 5 + ["full_attention"]
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
}
GEMMA3 = dict(
    family="gemma3",
    num_layers=6,
    layer_types=LAYER_TYPES,
    sliding_window=WINDOW,
    query_pre_attn_scalar=16,
    rope_parameters=ROPE,
)
ATOL = 1e-4
MAX_TOKENS = 12
needs_kernels = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gemma3-src"), seed=3, **GEMMA3)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=[T.F32, T.Q8_0], ids=["F32", "Q8_0"])
def gguf_file(request: pytest.FixtureRequest, src: Path, private_cache: None) -> Path:
    path = src.parent / f"gemma3-{request.param.name}.gguf"
    if not path.exists():
        write_gemma3_gguf(path, src, request.param)
    return path


def _reference(path: Path, src: Path, bf16: bool) -> Path:
    out = path.with_name(f"{path.stem}-ref{'-bf16' if bf16 else ''}")
    return out if out.exists() else gemma3_reference(path, src, out, bf16)


def _dense(quantization: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GGUF matrix multiplied dense (its blocks dequantized exactly, float32 GEMM) rather
    than by the native kernel, which rounds activations to int8 (that path: its own test)."""
    if quantization == "gguf":
        monkeypatch.setitem(native._dense_from, torch.float32, 0)


def test_config_is_read_as_llama_cpp_reads_it(gguf_file: Path, src: Path) -> None:
    """What transformers' reader leaves at its defaults (the attention scale, the global layers'
    rope scaling) comes from the file: the config is the source model's."""
    theirs = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    assert theirs.query_pre_attn_scalar != 16
    assert theirs.rope_parameters["full_attention"].get("rope_type") == "default"
    config = load_model(str(gguf_file), "gguf").hf_config
    want = AutoConfig.from_pretrained(str(src))
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.layer_types == want.layer_types and config.sliding_window == WINDOW
    assert config.query_pre_attn_scalar == 16
    for kind, params in ROPE.items():
        got = config.rope_parameters[kind]
        assert {k: got[k] for k in params} == params


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_logits_match_transformers_on_the_dequantized_weights(
    quantization: str, gguf_file: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`none`: the bfloat16 conversion, against those weights rounded so; `gguf`: the file's own
    blocks (Q8_0) or floats (F32), against them dequantized."""
    _dense(quantization, monkeypatch)
    ids = prompt_ids(30, seed=1)
    runner, ours = file_logits(gguf_file, quantization, ids)
    if quantization == "gguf" and "Q8_0" in gguf_file.name:
        assert "Q8_0" in runner.weights.label
    want = hf_logits(_reference(gguf_file, src, bf16=quantization == "none"), ids)
    assert (ours - want).abs().max().item() < ATOL


@needs_kernels
def test_native_kernels_within_activation_rounding(
    src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native Q8_0 kernel rounds activations to int8 per 16 values: logits within a few per
    cent of transformers' on the dequantized weights (1.7% here over six layers), not exact, by
    that rounding alone (the same blocks multiplied dense are exact: the tests above)."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "q8.gguf"
    write_gemma3_gguf(path, src, T.Q8_0)
    ids = prompt_ids(30, seed=2)
    _, ours = file_logits(path, "gguf", ids)
    want = hf_logits(_reference(path, src, bf16=False), ids)
    error = ((ours - want).norm() / want.norm()).item()
    assert 0 < error < 0.05, error


def _prompts() -> list[list[int]]:
    """Short prompts and prompts past the window."""
    return random_prompts(5, (3, 30), 300, seed=7)


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_greedy_equals_transformers(
    quantization: str, gguf_file: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dense(quantization, monkeypatch)
    engine = make_engine(gguf_file, quantization=quantization, max_num_batched_tokens=9)
    ref = _reference(gguf_file, src, bf16=quantization == "none")
    want = [hf_greedy(ref, p, MAX_TOKENS) for p in _prompts()]
    assert outputs(engine, _prompts(), greedy(MAX_TOKENS)) == want


def test_layer_pattern_and_rope_scaling_as_llama_cpp_reads_them() -> None:
    """The window pattern as an int (each n-th layer global) or one flag a layer; rope scaling
    linear unless named (factor from rope.scale_linear or rope.scaling.factor), another refused."""
    local, full = "sliding_attention", "full_attention"
    assert _layer_types(None, 7) == [local] * 5 + [full, local]
    assert _layer_types(2, 3) == [local, full, local]
    assert _layer_types([True, False], 2) == [local, full]
    meta: dict[str, object] = {"gemma3.rope.freq_base": 1e6, "gemma3.rope.scaling.factor": 8.0}
    assert _global_rope(meta, "gemma3") == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert _global_rope({"gemma3.rope.scale_linear": 1.0}, "gemma3")["rope_type"] == "default"
    with pytest.raises(ValueError, match="yarn"):
        _global_rope(meta | {"gemma3.rope.scaling.type": "yarn"}, "gemma3")
