"""Qwen3.5's MTP layer as a built-in draft (`speculative_method: mtp`): the head against a
reference built from transformers' own Qwen3.5 modules (transformers does not load `mtp.*`, so
the layer is assembled here as vLLM's Qwen3_5MultiTokenPredictor wires it), and the engine's
greedy output with it equal to transformers'."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_utils import chi_square_pvalue, greedy, hf_greedy, hf_model, make_engine, outputs
from family_utils import MAX_TOKENS, batched_prompts, max_diff, prompt_ids
from safetensors.torch import load_file, save_file
from test_qwen3_5_engine import NUM_SAMPLES, TEMPERATURE
from test_qwen3_5_engine import _exact_pair_probs as exact_pair_probs
from tiny import make_tiny_model, make_tiny_qwen3_5
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from engine.config import SpeculativeConfig
from engine.model.head_kv import HeadSpan
from engine.model.hybrid import HybridDecoderModel
from engine.model.loader import load_model
from engine.model.mtp import load_mtp_head
from engine.model.runner import ModelRunner
from engine.sample.sampling_params import SamplingParams

MTP = SpeculativeConfig(method="mtp", num_speculative_tokens=3, adaptive=False)


def _mtp_shapes(config: dict[str, int]) -> dict[str, tuple[int, ...]]:
    h, heads, kv, d = (config[k] for k in ("hidden_size", "heads", "kv_heads", "head_dim"))
    inter = config["intermediate_size"]
    layer = "layers.0."
    return {
        "fc.weight": (h, 2 * h),
        "pre_fc_norm_embedding.weight": (h,),
        "pre_fc_norm_hidden.weight": (h,),
        "norm.weight": (h,),
        layer + "input_layernorm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (2 * heads * d, h),
        layer + "self_attn.k_proj.weight": (kv * d, h),
        layer + "self_attn.v_proj.weight": (kv * d, h),
        layer + "self_attn.o_proj.weight": (h, heads * d),
        layer + "self_attn.q_norm.weight": (d,),
        layer + "self_attn.k_norm.weight": (d,),
        layer + "mlp.gate_proj.weight": (inter, h),
        layer + "mlp.up_proj.weight": (inter, h),
        layer + "mlp.down_proj.weight": (h, inter),
    }


def _add_mtp_weights(model_dir: Path, seed: int) -> None:
    """Random `mtp.*` tensors beside the model's, as a Qwen3.5 checkpoint carries them."""
    config = hf_model(model_dir).config
    sizes = dict(
        hidden_size=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
    )
    gen = torch.Generator().manual_seed(seed)
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, shape in _mtp_shapes(sizes).items():
        tensors[f"mtp.{name}"] = 0.2 * torch.randn(shape, generator=gen)  # norms: 1 + w
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_qwen3_5(tmp_path_factory.mktemp("qwen3_5_mtp"), seed=0)
    _add_mtp_weights(path, seed=5)
    return path


@torch.no_grad()
def _reference_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:  # [len(ids) - 1, vocab]
    """transformers' modules wired as vLLM's MTP: row i reads the final hidden state at i and
    the token at i + 1, and scores the token at i + 2."""
    model = hf_model(model_dir)
    config = copy.deepcopy(model.config)
    config.layer_types, config._attn_implementation = ["full_attention"], "eager"
    layer = hf.Qwen3_5DecoderLayer(config, 0).eval()
    norms = {n: hf.Qwen3_5RMSNorm(config.hidden_size, config.rms_norm_eps) for n in ("e", "h", "o")}
    weights = {k[4:]: v for k, v in load_file(str(model_dir / "model.safetensors")).items()
               if k.startswith("mtp.")}  # fmt: skip
    layer.load_state_dict({k[len("layers.0.") :]: v for k, v in weights.items()
                           if k.startswith("layers.0.")})  # fmt: skip
    for key, name in (("e", "pre_fc_norm_embedding"), ("h", "pre_fc_norm_hidden"), ("o", "norm")):
        norms[key].weight.copy_(weights[f"{name}.weight"])
    tokens = torch.tensor([ids])
    hidden = model.model(tokens).last_hidden_state[:, :-1]  # [1, n - 1, hidden], after the norm
    embeds = model.model.embed_tokens(tokens[:, 1:])
    x = torch.cat([norms["e"](embeds), norms["h"](hidden)], dim=-1) @ weights["fc.weight"].T
    n = x.shape[1]
    positions = torch.arange(n)[None]
    rope = hf.Qwen3_5TextRotaryEmbedding(config)(x, positions)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    out = layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
    return model.lm_head(norms["o"](out))[0]


def test_head_matches_transformers_modules(model_dir: Path) -> None:
    ids = prompt_ids(30, seed=11)
    runner = ModelRunner(load_model(str(model_dir)), "cpu", "float32", 4)
    target = runner.model
    assert isinstance(target, HybridDecoderModel)
    head = load_mtp_head(target, runner.loaded.iter_weights())
    hidden = hf_model(model_dir).model(torch.tensor([ids])).last_hidden_state[0, :-1]
    span = HeadSpan(head.new_cache(), 0, len(ids) - 1)
    with torch.no_grad():
        normed, fed_back = head(head.fuse(hidden), torch.tensor(ids[1:]), [span])
    assert torch.equal(normed, fed_back)
    assert max_diff(head.logits(normed), _reference_logits(model_dir, ids)) < 1e-4


def test_greedy_with_the_mtp_draft_equals_transformers(model_dir: Path) -> None:
    engine = make_engine(model_dir, speculative=MTP, max_num_batched_tokens=16)
    prompts = batched_prompts()
    seqs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == [
        hf_greedy(model_dir, p, MAX_TOKENS) for p in prompts
    ]
    assert sum(s.spec.num_draft_tokens for s in seqs) > 0  # the MTP head drafted


def test_mtp_needs_the_checkpoints_layers(model_dir: Path, tmp_path: Path) -> None:
    dense = make_tiny_model(tmp_path / "qwen3", family="qwen3")
    with pytest.raises(ValueError, match="has no MTP layers"):
        make_engine(dense, speculative=MTP)
    plain = make_tiny_qwen3_5(tmp_path / "plain", seed=0)
    with pytest.raises(ValueError, match="no MTP layers"):
        make_engine(plain, speculative=MTP)
    assert outputs(make_engine(plain), batched_prompts()[:1], greedy(2))  # served without it


def test_sampled_pairs_with_the_mtp_draft_follow_the_target(model_dir: Path) -> None:
    """Unseeded sampling, the MTP head's drafts verified by rejection sampling (its q after the
    request's temperature): given the likeliest first token, the next two keep the target's law.
    (The head drafts only after a step that computed just the last token: from the second
    token on.)"""
    prompt = batched_prompts()[2]
    engine = make_engine(
        model_dir,
        speculative=MTP,
        num_kv_blocks=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
    )
    params = SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True)
    seqs = engine.generate([prompt] * NUM_SAMPLES, params)
    assert sum(s.spec.num_draft_tokens for s in seqs) > NUM_SAMPLES // 2  # the head drafted
    outs = [s.output_token_ids for s in seqs]
    first = Counter(out[0] for out in outs).most_common(1)[0][0]
    pairs = [(out[1], out[2]) for out in outs if out[0] == first]
    assert len(pairs) > NUM_SAMPLES // 4 and len(set(pairs)) > 10
    assert chi_square_pvalue(pairs, exact_pair_probs(model_dir, prompt + [first])) > 1e-3
