"""gpt-oss from a GGUF file: a tiny random gpt-oss written as llama.cpp's converter writes it (gate
and up de-interleaved into stacked `ffn_{gate,up}_exps`, `ffn_down_exps`, their biases stacked in
F32, the router `ffn_gate_inp` with its bias, `attn_sinks`, YaRN's factor and original context in
the rope keys), experts in F32 or MXFP4 as gpt-oss ships them, the rest F32; loaded with
`quantization` none (dequantized by gguf's own reference) and gguf, against transformers' gpt-oss
holding the dequantized weights. With `gguf`, MXFP4 experts load as the file's MXFP4 blocks on the
native kernel: exact when multiplied dense, within the int8 activation rounding on the kernel, and
n-gram speculative greedy output equal to plain greedy output there."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from engine_utils import greedy, hf_greedy, make_engine, outputs, random_prompts
from family_utils import file_logits, hf_logits, prompt_ids
from gguf import GGMLQuantizationType as T
from gguf_blocks import finish, rounded_reference, save_reference
from safetensors.torch import load_file
from tiny import _gguf_hparams, _gguf_tokenizer, make_tiny_model

from engine.config import SpeculativeConfig
from engine.kernels import gguf_ops
from engine.model.loader import load_model
from engine.model.quant import native
from engine.model.quant.linear import QuantLinear

ROPE = {
    "rope_type": "yarn",
    "factor": 8.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
    "rope_theta": 150000.0,
}
GPT_OSS = dict(
    family="gpt_oss",
    num_layers=2,
    hidden_size=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=64,  # MXFP4 blocks of 32 along both of the experts' input widths
    sliding_window=8,
    rope_parameters=ROPE,
)
ATOL = 1e-4
MAX_TOKENS = 12
needs_kernels = pytest.mark.skipif(not gguf_ops.available(), reason="native kernels not built")


def _values(array: np.ndarray, kind: T) -> tuple[np.ndarray, np.ndarray, T | None]:
    """(the file's data, what gguf's reader gives back, the raw type) of a matrix in `kind`."""
    if kind == T.F32:
        return array, array, None
    data = gguf.quants.quantize(array, kind)
    return data, np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32), kind


def write_gpt_oss_gguf(path: Path, src: Path, kind: T) -> Path:
    """`src` as the converter writes it (experts in `kind`), and beside it (`<stem>-ref`) the
    model as safetensors holding the dequantized values in transformers' layout."""
    config = json.loads((src / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config["num_local_experts"]
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    _gguf_hparams(writer, config)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(ROPE["factor"])
    writer.add_rope_scaling_orig_ctx_len(ROPE["original_max_position_embeddings"])
    _gguf_tokenizer(writer, src)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    tensors, ref = load_file(str(src / "model.safetensors")), {}
    for name, tensor in sorted(tensors.items()):
        array = tensor.float().numpy()
        if ".experts." in name:
            continue
        base, suffix = name.rsplit(".", 1)
        if name.endswith("self_attn.sinks"):
            base, suffix = name, "weight"
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
        ref[name] = array
    for i in range(layers):
        e = f"model.layers.{i}.mlp.experts"
        gate_up, gate_up_bias = (
            tensors[f"{e}.gate_up_proj"].numpy(),
            tensors[f"{e}.gate_up_proj_bias"].numpy(),
        )
        stacked = {  # [E, rows, cols] as the converter writes them, biases [E, rows]
            "gate_proj": (gate_up[:, :, 0::2].transpose(0, 2, 1), gate_up_bias[:, 0::2]),
            "up_proj": (gate_up[:, :, 1::2].transpose(0, 2, 1), gate_up_bias[:, 1::2]),
            "down_proj": (
                tensors[f"{e}.down_proj"].numpy().transpose(0, 2, 1),
                tensors[f"{e}.down_proj_bias"].numpy(),
            ),
        }
        values = {}
        for part, (matrix, bias) in stacked.items():
            data, values[part], raw = _values(np.ascontiguousarray(matrix), kind)
            target = names.get_name(f"{e}.{part}")
            writer.add_tensor(f"{target}.weight", data, raw_dtype=raw)
            writer.add_tensor(f"{target}.bias", np.ascontiguousarray(bias))
        interleaved = np.empty_like(gate_up)  # back to transformers' [E, H, 2I], interleaved
        interleaved[:, :, 0::2] = values["gate_proj"].transpose(0, 2, 1)
        interleaved[:, :, 1::2] = values["up_proj"].transpose(0, 2, 1)
        ref[f"{e}.gate_up_proj"] = interleaved
        ref[f"{e}.down_proj"] = values["down_proj"].transpose(0, 2, 1)
        ref[f"{e}.gate_up_proj_bias"] = gate_up_bias
        ref[f"{e}.down_proj_bias"] = tensors[f"{e}.down_proj_bias"].numpy()
    finish(writer)
    save_reference(src, path.with_name(f"{path.stem}-ref"), ref)
    return path


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss-src"), seed=5, **GPT_OSS)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=[T.F32, T.MXFP4], ids=["F32", "MXFP4"])
def gguf_file(request: pytest.FixtureRequest, src: Path, private_cache: None) -> Path:
    path = src.parent / f"gpt-oss-{request.param.name}.gguf"
    return path if path.exists() else write_gpt_oss_gguf(path, src, request.param)


def _ref(path: Path, bf16: bool = False) -> Path:
    """The dequantized reference; with `bf16` rounded as `none`'s conversion stores it."""
    ref = path.with_name(f"{path.stem}-ref")
    return rounded_reference(ref) if bf16 else ref


def test_config_is_read_as_llama_cpp_reads_it(gguf_file: Path, src: Path) -> None:
    config = load_model(str(gguf_file), "none").hf_config
    want = json.loads((src / "config.json").read_text())
    for key in ("intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window"):
        assert getattr(config, key) == want[key], key
    assert list(config.layer_types) == want["layer_types"]
    for key in ("rope_type", "factor", "original_max_position_embeddings", "rope_theta"):
        assert config.rope_parameters[key] == ROPE[key], key


def _mxfp4(path: Path) -> bool:
    return path.name.endswith("MXFP4.gguf")


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_logits_match_transformers_on_the_dequantized_weights(
    quantization: str, gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gguf`: the experts' MXFP4 blocks multiplied dense (dequantized exactly, float32 GEMM)
    rather than by the native kernel, which rounds activations to int8 (the next test)."""
    if quantization == "gguf" and _mxfp4(gguf_file):
        if not gguf_ops.available():
            pytest.skip("native kernels not built")
        monkeypatch.setattr(native.GgufKernel, "native", native.GgufKernel.dense)
    ids = prompt_ids(30, seed=1)
    runner, ours = file_logits(gguf_file, quantization, ids)
    if quantization == "gguf" and _mxfp4(gguf_file):
        expert = runner.model.layers[1].mlp.experts[2].down_proj  # type: ignore[union-attr,index]
        assert isinstance(expert, QuantLinear) and expert.formats == ["MXFP4"]
    want = hf_logits(_ref(gguf_file, bf16=quantization == "none"), ids)
    assert (ours - want).abs().max().item() < ATOL


@needs_kernels
def test_native_mxfp4_within_activation_rounding(src: Path, private_cache: None) -> None:
    """On the native kernel the MXFP4 experts (and nothing else: the rest is F32) take int8
    activations per 16 values: logits within a few per cent of transformers' on the dequantized
    weights, by that rounding alone (the same blocks multiplied dense are exact: the test above)."""
    path = src.parent / "gpt-oss-MXFP4.gguf"
    path = path if path.exists() else write_gpt_oss_gguf(path, src, T.MXFP4)
    ids = prompt_ids(30, seed=2)
    _, ours = file_logits(path, "gguf", ids)
    want = hf_logits(_ref(path), ids)
    error = ((ours - want).norm() / want.norm()).item()
    assert 0 < error < 0.05, error


def _prompts() -> list[list[int]]:
    repeats = [p * 3 for p in random_prompts(2, (4, 8), 300, seed=9)]  # n-gram matches
    return random_prompts(4, (3, 30), 300, seed=7) + repeats


def test_greedy_equals_transformers(gguf_file: Path) -> None:
    """`none` (dequantized, bfloat16 weights): batched, chunks of at most 9, plain and n-gram."""
    want = [hf_greedy(_ref(gguf_file, bf16=True), p, MAX_TOKENS) for p in _prompts()]
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    for spec in (SpeculativeConfig(), ngram):
        engine = make_engine(
            gguf_file, quantization="none", max_num_batched_tokens=9, speculative=spec
        )
        assert outputs(engine, _prompts(), greedy(MAX_TOKENS)) == want


@needs_kernels
def test_native_ngram_greedy_equals_plain_greedy(gguf_file: Path) -> None:
    """On the native MXFP4 kernel (activations rounded to int8, so not transformers' numbers) a
    verified row is computed as the decode it replaces: n-gram drafts change no token."""
    if not _mxfp4(gguf_file):
        pytest.skip("F32 experts run on torch's GEMM (test_greedy_equals_transformers)")
    plain = make_engine(gguf_file, quantization="gguf", max_num_batched_tokens=9)
    want = outputs(plain, _prompts(), greedy(MAX_TOKENS))
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    engine = make_engine(
        gguf_file, quantization="gguf", max_num_batched_tokens=9, speculative=ngram
    )
    assert outputs(engine, _prompts(), greedy(MAX_TOKENS)) == want
    assert len({tuple(out) for out in want}) > 1  # not one degenerate answer for every prompt
