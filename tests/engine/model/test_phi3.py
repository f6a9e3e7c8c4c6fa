"""Phi-3 / Phi-4 (Phi3ForCausalLM) served exactly: Llama's layer, from a checkpoint whose q/k/v
and gate/up matrices are fused already (split at load, fused again by the decoder), with its
rope (plain, as Phi-4's, or longrope's short factors within original_max_position_embeddings),
partial rotary (Phi-4-mini's) included; against transformers' own Phi3 on tiny random models in
float32."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_utils import hf_model, random_prompts
from family_utils import assert_greedy_equals_transformers
from safetensors import safe_open
from tiny import make_tiny_model
from transformers import LlamaConfig

from engine.model.families import build_decoder
from engine.model.loader import LoadedModel, load_model
from engine.model.runner import ForwardInput, ModelRunner

ORIGINAL = 48  # longrope's original_max_position_embeddings: the served length
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.3 * i for i in range(8)],  # head_dim 16: 8 frequencies
    "long_factor": [4.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": ORIGINAL,
}
PHI3 = dict(
    family="phi3", num_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 250000.0}
)
PHI3_LONGROPE = dict(family="phi3", num_layers=2, original_max_position_embeddings=ORIGINAL,
                     rope_parameters=LONGROPE)  # fmt: skip
ATOL = 1e-4


@pytest.fixture(scope="module")
def phi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("phi3"), seed=0, **PHI3)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("phi3-longrope"), seed=2, **PHI3_LONGROPE)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer Phi3 draft, other weights (seed 1)."""
    draft = PHI3 | dict(num_layers=1)
    return make_tiny_model(tmp_path_factory.mktemp("phi3-draft"), seed=1, **draft)  # type: ignore[arg-type]


def _ids(n: int, seed: int) -> list[int]:
    return random_prompts(1, (n, n), 300, seed)[0]


def _runner(loaded: LoadedModel) -> ModelRunner:
    runner = ModelRunner(loaded, "cpu", "float32", 4)
    runner.allocate_kv_cache(48)
    return runner


def _chunked(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:  # [len(ids), V]
    """Prompt chunks, a 4-token verify query and single decodes, through shuffled blocks."""
    runner, table = _runner(loaded), list(range(47, -1, -1))
    outs, pos = [], 0
    for size in (7, 1, 4, 20, 1, 100):
        chunk = ids[pos : pos + size]
        if chunk:
            outs.append(runner.forward([ForwardInput(chunk, pos, table, len(chunk))]))
        pos += len(chunk)
    return torch.cat(outs)


@torch.no_grad()
def _reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    return hf_model(model_dir)(torch.tensor([ids])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff}"


def test_phi3_is_llamas_layer_from_a_fused_checkpoint(phi_dir: Path) -> None:
    loaded = load_model(str(phi_dir))
    assert loaded.architecture == "Phi3ForCausalLM"
    shape = build_decoder(loaded.architecture, loaded.hf_config).shape
    assert not (shape.qkv_bias or shape.qk_norm or shape.norm_offset or shape.layer_types)
    assert not shape.tie_word_embeddings and shape.activation == "silu"
    with safe_open(str(phi_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in keys
    assert "model.layers.0.mlp.gate_up_proj.weight" in keys
    assert not any("q_proj" in k or "gate_proj" in k for k in keys)
    names = [name for name, _ in loaded.iter_weights()]
    assert "model.layers.0.self_attn.k_proj.weight" in names
    assert "model.layers.0.mlp.up_proj.weight" in names


def test_logits_match_transformers(phi_dir: Path) -> None:
    ids = _ids(40, seed=1)
    _assert_close(_chunked(load_model(str(phi_dir)), ids), _reference(phi_dir, ids))


def test_longrope_short_factors_within_the_original_length(longrope_dir: Path) -> None:
    """transformers rotates a sequence within original_max_position_embeddings by the short
    factors (and the attention factor on cos and sin); past it, every position moves to the long
    ones at once, which cached keys cannot follow: the served length stops there."""
    loaded = load_model(str(longrope_dir))
    assert _runner(loaded).max_model_len == ORIGINAL
    ids = _ids(ORIGINAL, seed=3)
    ours = _chunked(loaded, ids)
    _assert_close(ours, _reference(longrope_dir, ids))
    # the factors matter: the same weights with a plain rope give other logits
    plain = load_model(str(longrope_dir)).hf_config
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    unscaled = _chunked(replace(loaded, hf_config=plain), ids)
    assert (ours - unscaled).abs().max().item() > 1e-2


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_partial_rotary_matches_transformers(rope: str, tmp_path: Path) -> None:
    """Phi-4-mini rotates 3/4 of each head (here 12 of 16 dims, with longrope's short factors as
    it has them): its q and k heads reordered at load, the decoder's rope passing the rest."""
    params: dict[str, object] = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "longrope":
        params = LONGROPE | {"short_factor": [1.0 + 0.3 * i for i in range(6)],
                             "long_factor": [4.0 + 0.5 * i for i in range(6)],
                             "partial_rotary_factor": 0.75}  # fmt: skip
    config = dict(PHI3_LONGROPE, partial_rotary_factor=0.75, rope_parameters=params)
    model_dir = make_tiny_model(tmp_path / "phi3-partial", seed=4, **config)  # type: ignore[arg-type]
    loaded = load_model(str(model_dir))
    assert loaded.hf_config.rope_parameters["partial_rotary_factor"] == 0.75
    ids = _ids(ORIGINAL, seed=5)
    ours = _chunked(loaded, ids)
    _assert_close(ours, _reference(model_dir, ids))
    if rope == "default":  # the same weights rotating every dim give other logits
        whole = load_model(str(model_dir)).hf_config
        whole.rope_parameters = {**whole.rope_parameters, "partial_rotary_factor": 1.0}
        whole.partial_rotary_factor = 1.0
        assert (ours - _chunked(replace(loaded, hf_config=whole), ids)).abs().max().item() > 1e-2


def test_partial_rotary_elsewhere_is_refused_by_name() -> None:
    config = LlamaConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, partial_rotary_factor=0.5,
    )  # fmt: skip
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        build_decoder("LlamaForCausalLM", config)


@pytest.mark.parametrize("kind", ["none", "ngram", "draft"])
def test_greedy_equals_transformers(kind: str, phi_dir: Path, draft_dir: Path) -> None:
    assert_greedy_equals_transformers(kind, phi_dir, draft_dir)


def _as_llama(phi_dir: Path, out: Path) -> Path:
    """The same model as a Llama checkpoint: q/k/v and gate/up as separate matrices."""
    from transformers import AutoModelForCausalLM

    phi = AutoModelForCausalLM.from_pretrained(str(phi_dir), dtype=torch.float32)
    c = phi.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=c.rope_parameters, tie_word_embeddings=False,
    )  # fmt: skip
    state = {}
    for name, tensor in phi.state_dict().items():
        if "qkv_proj" in name:
            kv = (tensor.shape[0] - c.hidden_size) // 2
            parts = tensor.split([c.hidden_size, kv, kv])
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                state[name.replace("qkv_proj", part)] = rows
        elif "gate_up_proj" in name:
            gate, up = tensor.chunk(2)
            state |= {name.replace("gate_up", "gate"): gate, name.replace("gate_up", "up"): up}
        else:
            state[name] = tensor
    llama = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    llama.load_state_dict(state)
    llama.save_pretrained(str(out))
    for tokenizer_file in phi_dir.glob("tokenizer*"):
        (out / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
    return out


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_loads_as_the_same_model_as_llama(quantization: str, phi_dir: Path, tmp_path: Path) -> None:
    """Split at load, the fused checkpoint is the Llama one: the same logits bit for bit, float
    or quantized (int8 rounds the split matrices row by row as any family's)."""
    llama = _as_llama(phi_dir, tmp_path / "llama")
    assert _reference(llama, _ids(20, seed=4)).allclose(_reference(phi_dir, _ids(20, seed=4)))
    logits = []
    for model_dir in (phi_dir, llama):
        runner = ModelRunner(load_model(str(model_dir), quantization), "cpu", "float32", 4)  # type: ignore[arg-type]
        runner.allocate_kv_cache(16)
        ids = _ids(20, seed=4)
        logits.append(runner.forward([ForwardInput(ids, 0, list(range(16)), len(ids))]))
    assert torch.equal(*logits)
