"""Phi-3/Phi-4, Granite, SmolLM3, OLMo 2 and GLM-4 from GGUF files, exact: tiny random models
written as llama.cpp's converter writes each (tests/gguf_families.py: Phi-3's fused q/k/v and
gate/up with its longrope factors as tensors and a partial rotary, Granite's scales, SmolLM3 and
Granite with q/k permuted as Llama's, GLM-4's interleaved rotary dims as halves), in F32 and
Q8_0, loaded with `quantization` gguf (the file's blocks) and none (converted to bfloat16
safetensors), against transformers holding the same weights as gguf's
own reader dequantizes them. transformers cannot read the Granite, SmolLM3, OLMo 2 and GLM-4
files at all, nor the Phi-3 file's rope (engine/model/gguf_dense.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, make_engine, outputs
from family_utils import (
    MAX_TOKENS,
    assert_greedy_equals_transformers,
    batched_prompts,
    hf_logits,
    max_diff,
    prompt_ids,
    runner_logits,
)
from gguf import GGMLQuantizationType as T
from gguf_families import family_reference, write_family_gguf
from tiny import CHAT_TEMPLATE, make_tiny_model
from transformers import AutoConfig, AutoTokenizer

from engine.config import SpeculativeConfig
from engine.kernels import gguf_ops
from engine.model.loader import load_model
from engine.model.quant import native

ORIGINAL = 48  # Phi-3's longrope original_max_position_embeddings: the served length
PHI3_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.3 * i for i in range(6)],  # 12 of head_dim 16 rotate: 6 frequencies
    "long_factor": [4.0 + 0.5 * i for i in range(6)],
    "original_max_position_embeddings": ORIGINAL,
    "partial_rotary_factor": 0.75,
}
FAMILIES: dict[str, dict[str, object]] = {
    # Phi-4-mini's shape: longrope within the original length, 3/4 of each head rotating
    "phi3": dict(
        num_layers=2,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters=PHI3_ROPE,
    ),  # fmt: skip
    "granite": dict(
        num_layers=3,
        embedding_multiplier=6.0,
        attention_multiplier=0.1,
        residual_multiplier=0.5,
        logits_scaling=2.0,
    ),  # fmt: skip
    "smollm3": dict(num_layers=4),  # layer 3 without rope, as llama.cpp's fixed step of 4
    "olmo2": dict(num_layers=2),
    "glm4": dict(num_layers=2),  # half of each head rotating, interleaved; q/k/v biases
}
ATOL = 1e-4
needs_kernels = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")
pytestmark = pytest.mark.usefixtures("private_cache")  # converted files in this module's own cache


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def src(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return make_tiny_model(tmp_path_factory.mktemp(family), family, seed=3, **FAMILIES[family])  # type: ignore[arg-type]


def _gguf(src: Path, kind: T) -> Path:
    path = src.parent / f"{src.name}-{kind.name}.gguf"
    if not path.exists():
        write_family_gguf(path, src, kind)
    return path


def _reference(src: Path, kind: T, bf16: bool = False) -> Path:
    out = src.parent / f"{src.name}-{kind.name}-ref{'-bf16' if bf16 else ''}"
    return out if out.exists() else family_reference(src, kind, out, bf16)


def _dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file's blocks multiplied dense (dequantized exactly, float32 GEMM) rather than by the
    native kernel, whose int8 activations move logits by a few per cent (test_gemma3_gguf.py)."""
    monkeypatch.setitem(native._dense_from, torch.float32, 0)


def test_config_is_read_as_llama_cpp_reads_it(src: Path) -> None:
    """The config from the file's metadata (and Phi-3's factor tensors) is the source model's."""
    loaded = load_model(str(_gguf(src, T.F32)), "gguf")
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE  # the file's own
    assert loaded.tokenizer.get_vocab() == AutoTokenizer.from_pretrained(str(src)).get_vocab()
    got, want = loaded.hf_config, AutoConfig.from_pretrained(str(src))
    assert got.architectures == want.architectures
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps"]  # fmt: skip
    fields += {
        "granite": [
            "embedding_multiplier",
            "attention_multiplier",
            "residual_multiplier",
            "logits_scaling",
        ],  # fmt: skip
        "smollm3": ["no_rope_layers"],
        "phi3": ["original_max_position_embeddings", "partial_rotary_factor"],
        "olmo2": [],
        "glm4": ["attention_bias"],
    }[want.model_type]
    for f in fields:
        assert getattr(got, f) == _approx(getattr(want, f)), f
    ours, theirs = got.rope_parameters, want.rope_parameters
    for k, v in theirs.items():
        assert ours.get(k) == _approx(v), k


def _approx(value: object) -> object:
    """A GGUF stores floats in float32: equal as the model's float32 tensors round them."""
    return pytest.approx(value, rel=1e-7) if isinstance(value, (float, list)) else value


@needs_kernels
@pytest.mark.parametrize(
    ("quantization", "kind"), [("gguf", T.F32), ("gguf", T.Q8_0), ("none", T.Q8_0)]
)
def test_logits_match_transformers(
    quantization: str, kind: T, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gguf`: the file's floats or blocks, against them dequantized; `none`: the bfloat16
    conversion (gguf's reference dequantization here: transformers cannot read these files),
    against those weights rounded so."""
    _dense(monkeypatch)
    loaded = load_model(str(_gguf(src, kind)), quantization)  # type: ignore[arg-type]
    assert loaded.quantization == quantization
    ref = _reference(src, kind, bf16=quantization == "none")
    for seed, n in ((1, 40), (2, 13)):
        ids = prompt_ids(n, seed)
        want = hf_logits(ref, ids)
        assert max_diff(runner_logits(loaded, ids), want) < ATOL


@pytest.fixture(scope="module")
def draft_dir(src: Path) -> Path:
    """A 1-layer draft of the family as safetensors, other weights (seed 1)."""
    family = AutoConfig.from_pretrained(str(src)).model_type
    config = FAMILIES[family] | dict(num_layers=1)
    return make_tiny_model(src.parent / "draft", family, seed=1, **config)  # type: ignore[arg-type]


@needs_kernels
@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(
    kind: str, src: Path, draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batched, chunked prefill, prefix caching on; the Q8_0 file's blocks."""
    _dense(monkeypatch)
    path, ref = _gguf(src, T.Q8_0), _reference(src, T.Q8_0)
    assert_greedy_equals_transformers(kind, path, draft_dir, reference=ref, quantization="gguf")


@needs_kernels
def test_native_speculative_greedy_equals_plain(src: Path) -> None:
    """On the native kernels (int8 activations, not exact against transformers) a row's logits
    do not depend on the batch or the rows beside it: n-gram speculation gives plain's text."""
    path = _gguf(src, T.Q8_0)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    plain = make_engine(path, quantization="gguf", max_num_batched_tokens=9)
    ngram = make_engine(path, quantization="gguf", max_num_batched_tokens=9, speculative=spec)
    want = outputs(plain, batched_prompts(), greedy(MAX_TOKENS))
    assert outputs(ngram, batched_prompts(), greedy(MAX_TOKENS)) == want
