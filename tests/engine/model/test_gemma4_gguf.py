"""Gemma 4 from a GGUF file (llama.cpp's `gemma4`), exact: tiny random Gemma 4s written as
llama.cpp's converter writes them (tests/gguf_gemma4.py), the dense variant (values from the keys
at the global layers, which have their own head size and KV heads) and the small-model variant
(per-layer embeddings, the last two layers KV-shared with double-wide MLPs, another proportional
share and thetas), in F32 and Q8_0, loaded with `quantization` none (bfloat16 safetensors) and
gguf (the file's blocks), against transformers' Gemma 4 holding the weights gguf's own reader
dequantizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import greedy, make_engine, outputs
from family_utils import assert_greedy_equals_transformers, file_logits, hf_logits, prompt_ids
from gguf import GGMLQuantizationType as T
from gguf_gemma4 import gemma4_reference, write_gemma4_gguf
from test_gemma4 import FULL, LOCAL, SMALL, _tiny_gemma4
from tiny import CHAT_TEMPLATE
from transformers import AutoConfig

from engine.config import SpeculativeConfig
from engine.kernels import gguf_ops
from engine.model.gguf_gemma4 import _kv_heads, _mlp_width, _rotated_share
from engine.model.loader import load_model
from engine.model.quant import native
from engine.model.quant.gguf_file import GgufTensorInfo

ATOL = 2e-4  # float32, logits up to the soft cap of 30: the small variant comes to 1.3e-4
needs_kernels = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")
VARIANTS = {
    "dense": {},
    "small": SMALL
    | dict(
        hidden_size_per_layer_input=16,  # the per-layer table's rows whole Q8_0 blocks
        attention_k_eq_v=False,  # as E2B/E4B: values of their own, KV heads alike
        rope_parameters={
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 5e4},
            LOCAL: {"rope_type": "default", "rope_theta": 5e3},
        },
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def src(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    return _tiny_gemma4(path, 5, **VARIANTS[request.param])


@pytest.fixture(scope="module", params=[T.F32, T.Q8_0], ids=["F32", "Q8_0"])
def gguf_file(request: pytest.FixtureRequest, src: Path, private_cache: None) -> Path:
    path = src.parent / f"{src.name}-{request.param.name}.gguf"
    if not path.exists():
        write_gemma4_gguf(path, src, request.param)
    return path


def _reference(path: Path, src: Path, bf16: bool) -> Path:
    out = path.with_name(f"{path.stem}-ref{'-bf16' if bf16 else ''}")
    return out if out.exists() else gemma4_reference(path, src, out, bf16)


def _dense(quantization: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every GGUF matrix multiplied dense (its blocks dequantized exactly, float32 GEMM) rather
    than by the native kernel, which rounds activations to int8 (that path: its own test)."""
    if quantization == "gguf":
        monkeypatch.setitem(native._dense_from, torch.float32, 0)
        # the head's rows of a step that mixes prompt chunks and decodes (not the step's tokens)
        # run native otherwise: int8 activations flip a near-tie (0.013 apart, small Q8_0)
        monkeypatch.setattr(native, "_native_rows", lambda rows, dense_from: None)


def test_config_is_read_as_llama_cpp_reads_it(gguf_file: Path, src: Path) -> None:
    """Every field the decoder reads is the source model's (head size and KV heads by kind of
    layer); the tokenizer and template too."""
    loaded = load_model(str(gguf_file), "gguf")
    got, want = loaded.hf_config, AutoConfig.from_pretrained(str(src))
    assert got.architectures == ["Gemma4ForCausalLM"]
    fields = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
        "layer_types sliding_window rms_norm_eps "
        "final_logit_softcapping hidden_size_per_layer_input vocab_size_per_layer_input "
        "num_kv_shared_layers use_double_wide_mlp attention_k_eq_v tie_word_embeddings"
    ).split()
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    for kind in (LOCAL, FULL):
        assert got.rope_parameters[kind] == want.rope_parameters[kind]
        g, w = got.per_layer_config[kind], want.per_layer_config[kind]
        assert (g.head_dim, g.num_key_value_heads) == (w.head_dim, w.num_key_value_heads)
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.tokenizer.encode("def fibonacci(n):") == _src_tokenizer(src).encode(
        "def fibonacci(n):"
    )


def _src_tokenizer(src: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(src))


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_logits_match_transformers_on_the_dequantized_weights(
    quantization: str, gguf_file: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`none`: the bfloat16 conversion, against those weights rounded so; `gguf`: the file's own
    blocks (Q8_0) or floats (F32), against them dequantized. Two prompts, one past the window,
    each through a prompt chunk, a verify query and a decode."""
    _dense(quantization, monkeypatch)
    want_model = _reference(gguf_file, src, bf16=quantization == "none")
    for n, seed in ((30, 1), (11, 2)):
        ids = prompt_ids(n, seed)
        runner, ours = file_logits(gguf_file, quantization, ids)
        if quantization == "gguf" and "Q8_0" in gguf_file.name:
            assert "Q8_0" in runner.weights.label
        diff = (ours - hf_logits(want_model, ids)).abs().max().item()
        assert diff < ATOL, f"max abs diff {diff}"


@needs_kernels
@pytest.mark.parametrize("kind", ["none", "ngram"])
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_greedy_equals_transformers(
    kind: str, quantization: str, gguf_file: Path, src: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six requests batched, prompts in chunks of at most 9 tokens, plain and under n-gram
    speculation (prompts that repeat, so drafts are proposed and some accepted)."""
    _dense(quantization, monkeypatch)
    reference = _reference(gguf_file, src, bf16=quantization == "none")
    assert_greedy_equals_transformers(
        kind, gguf_file, src, reference=reference, quantization=quantization
    )


@needs_kernels
def test_ngram_speculation_equals_plain_on_the_native_kernels(gguf_file: Path) -> None:
    """The native Q8_0 kernels (activations rounded to int8) are not transformers', but greedy
    under n-gram speculation is the same tokens as without it."""
    prompts = [p * 3 for p in (prompt_ids(6, 3), prompt_ids(5, 4))] + [prompt_ids(25, 5)]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    plain = make_engine(gguf_file, quantization="gguf", max_num_batched_tokens=9)
    ngram = make_engine(gguf_file, quantization="gguf", max_num_batched_tokens=9, speculative=spec)
    assert outputs(ngram, prompts, greedy(16)) == outputs(plain, prompts, greedy(16))


def test_per_layer_values_as_llama_cpp_reads_them() -> None:
    """Double-wide widths on the shared layers only; KV heads uniform within a kind; the rope
    factors 1 then 1e30, any other refused."""
    assert _mlp_width(128, 6, 2) == (128, False)
    assert _mlp_width([128] * 4 + [256] * 2, 6, 2) == (128, True)
    with pytest.raises(ValueError, match="feed_forward_length"):
        _mlp_width([128, 256, 128, 128], 4, 1)
    types = [LOCAL, LOCAL, FULL]
    assert _kv_heads([2, 2, 1], types) == (2, 1) and _kv_heads(4, types) == (4, 4)
    with pytest.raises(ValueError, match="varies"):
        _kv_heads([2, 1, 1], types)
    assert _rotated_share(_factors([1.0, 1.0, 1e30, 1e30]), 8) == 0.5
    assert _rotated_share(None, 8) == 1.0
    with pytest.raises(ValueError, match="rope_freqs"):
        _rotated_share(_factors([1.0, 0.5, 1e30, 1e30]), 8)


def _factors(values: list[float]) -> GgufTensorInfo:
    import numpy as np

    return GgufTensorInfo("rope_freqs.weight", T.F32, np.array(values, dtype=np.float32), 0)
