"""EAGLE-3 heads in the public format: they load, draft, and change no output.

Two heads, written by the test as config.json + model.safetensors the way vLLM and SGLang read
them (fc, midlayer.*, norm, lm_head over a reduced draft vocabulary, d2t / t2d):
- a random head on the tiny random target: it accepts little, which is the point of the lossless
  checks (greedy equal to plain, batched, chunked prefill, prefix cache, a sampled distribution,
  seeds);
- a head built to copy a "bigram" target (every layer adds nothing, so each next token is a
  function of the current one): its first draft is always right, which shows the drafts really
  come from the target's hidden states at the right positions.
The head's arithmetic is checked against a dense reference written from the format's description,
and the target's kept streams against transformers' hidden states.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_utils import chi_square_pvalue, greedy, hf_model, make_engine, outputs, random_prompts
from safetensors.torch import load_file, save_file
from tiny import make_tiny_model

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model.eagle3 import Eagle3Config, load_eagle3_head
from engine.model.head_kv import HeadSpan
from engine.model.runner import ForwardInput
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import Constraints, grammar_from

MAX_TOKENS = 12
HEAD_HIDDEN = 64  # the tiny targets' hidden size (the head shares their embedding)
Weights = dict[str, torch.Tensor]


def write_head(
    path: Path,
    target: Path,
    draft_ids: list[int],  # target id of each draft id, ascending
    seed: int = 0,
    edit: Callable[[Weights], None] | None = None,  # set some weights after the random init
) -> Path:
    """A random one-layer EAGLE-3 head for `target` in the public format."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    vocab, layers = cfg["vocab_size"], cfg["num_hidden_layers"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "draft_vocab_size": len(draft_ids),
        "target_hidden_size": cfg["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, layers // 2, layers]},
        "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return 0.2 * torch.randn(*shape, generator=gen)

    h = cfg["hidden_size"]  # the head shares the target's embedding
    kv = 2 * h // 4
    weights: Weights = {
        "fc.weight": rand(h, 3 * cfg["hidden_size"]),
        "midlayer.self_attn.q_proj.weight": rand(h, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, h),
        "midlayer.mlp.gate_proj.weight": rand(96, h),
        "midlayer.mlp.up_proj.weight": rand(96, h),
        "midlayer.mlp.down_proj.weight": rand(h, 96),
        "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.hidden_norm.weight": 1 + rand(h),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "norm.weight": 2 + rand(h),  # spreads the head's logits, as tiny.py does the target's
        "lm_head.weight": rand(len(draft_ids), h),
    }
    ids = torch.tensor(draft_ids)
    weights["d2t"] = ids - torch.arange(len(draft_ids))
    weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, ids, True)
    if edit is not None:
        edit(weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def eagle3_engine(
    target: Path, head: Path, k: int = 3, adaptive: bool = False, **overrides: object
) -> LLMEngine:
    spec = SpeculativeConfig(
        method="eagle3", num_speculative_tokens=k, draft_model=str(head), adaptive=adaptive
    )
    return make_engine(target, speculative=spec, **overrides)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir: Path) -> int:
    return hf_model(tiny_model_dir).config.vocab_size


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, vocab: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random head whose draft vocabulary is every other id of the target's (and the eos)."""
    draft_ids = sorted({*range(0, vocab, 2), 0})
    return write_head(tmp_path_factory.mktemp("eagle3"), tiny_model_dir, draft_ids)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLMEngine:
    return make_engine(tiny_model_dir)


def _drafted(seqs: list) -> tuple[int, int]:  # type: ignore[type-arg]
    return sum(s.spec.num_draft_tokens for s in seqs), sum(s.spec.num_accepted_tokens for s in seqs)


def test_config_reads_the_public_format(head_dir: Path) -> None:
    config = Eagle3Config.read(head_dir)
    assert config.draft_vocab_size < config.vocab_size
    assert config.aux_layers(2) == (0, 1, 2)
    with pytest.raises(ValueError, match="three distinct"):
        Eagle3Config(**{**config.__dict__, "aux_layer_ids": None}).aux_layers(4)


def _reference_logits(head: Path, embed: torch.Tensor, aux: torch.Tensor, nxt: torch.Tensor):  # type: ignore[no-untyped-def]
    """The head's draft-vocabulary logits at positions 0..T-1, written out densely from the
    public description (vLLM's llama_eagle3): aux [T, 3 * target_hidden], nxt [T] next tokens."""
    w, cfg = (
        load_file(str(head / "model.safetensors")),
        json.loads((head / "config.json").read_text()),
    )
    heads, kv_heads, eps = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["rms_norm_eps"],
    )
    dim, num = HEAD_HIDDEN // heads, aux.shape[0]

    def rms(x: torch.Tensor, name: str) -> torch.Tensor:
        return w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, n, dim], rotate_half form
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        ang = torch.arange(num).float()[:, None] * inv[None]
        cos, sin = (
            torch.cat([ang, ang], -1).cos()[:, None],
            torch.cat([ang, ang], -1).sin()[:, None],
        )
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = aux @ w["fc.weight"].T
    x = torch.cat(
        [rms(embed[nxt], "midlayer.input_layernorm.weight"), rms(h, "midlayer.hidden_norm.weight")],
        -1,
    )
    proj = {n: x @ w[f"midlayer.self_attn.{n}_proj.weight"].T for n in "qkv"}
    q = rope(proj["q"].view(num, heads, dim)).transpose(0, 1)
    k = (
        rope(proj["k"].view(num, kv_heads, dim))
        .repeat_interleave(heads // kv_heads, 1)
        .transpose(0, 1)
    )
    v = proj["v"].view(num, kv_heads, dim).repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    scores = (q @ k.transpose(1, 2)) / dim**0.5 + torch.full((num, num), -torch.inf).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(num, heads * dim)
    r = h + attn @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(r, "midlayer.post_attention_layernorm.weight")
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    r = r + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return rms(r, "norm.weight") @ w["lm_head.weight"].T  # [T, draft_vocab]


def test_the_head_computes_what_the_format_describes(
    head_dir: Path, tiny_model_dir: Path, vocab: int
) -> None:
    """Run in pieces over its own cache (a catch-up of 5 rows, then one row at a time, as when
    drafting), the head gives the dense reference's logits at every position, each at its
    target id (d2t) and -inf elsewhere."""
    target_hidden = 3 * json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    gen = torch.Generator().manual_seed(5)
    embed = torch.nn.Embedding(vocab, HEAD_HIDDEN)
    torch.nn.init.normal_(embed.weight, generator=gen)
    aux, nxt = (
        torch.randn(9, target_hidden, generator=gen),
        torch.randint(vocab, (9,), generator=gen),
    )
    head = load_eagle3_head(
        str(head_dir), embed, HEAD_HIDDEN, vocab, 64, torch.device("cpu"), torch.float32
    )
    cache, rows = head.new_cache(), []
    with torch.no_grad():
        for start, end in [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)]:
            span = HeadSpan(cache, start, end - start)
            normed, _ = head(head.fuse(aux[start:end]), nxt[start:end], [span])
            rows.append(head.logits(normed))
        expected = _reference_logits(head_dir, embed.weight, aux, nxt)
    logits = torch.cat(rows)
    ids = head.target_ids
    torch.testing.assert_close(logits[:, ids], expected, rtol=1e-4, atol=1e-4)
    assert torch.isinf(logits).sum() == 9 * (vocab - len(ids))


def test_the_target_keeps_the_streams_entering_the_head_layers(
    tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    """Layer ids as vLLM reads them: j is the stream entering layer j (transformers'
    hidden_states[j]); j == num_layers, an extension, the last layer's output before the norm."""
    engine = eagle3_engine(tiny_model_dir, head_dir)
    prompt = random_prompts(1, (11, 11), vocab, seed=79)[0]
    table = list(range(3))  # 12 slots of 4; no request holds them yet
    engine.target.forward([ForwardInput(prompt, 0, table, 1)])
    kept = engine.target.aux_hidden(table, 0, len(prompt))  # [11, 3 * hidden]
    model, before_norm = hf_model(tiny_model_dir), []
    hook = model.model.norm.register_forward_hook(lambda m, args, out: before_norm.append(args[0]))
    with torch.no_grad():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    hook.remove()
    expected = torch.cat([states[0][0], states[1][0], before_norm[0][0]], dim=-1)
    torch.testing.assert_close(kept, expected, rtol=1e-4, atol=1e-4)


def _drop_hidden_norm(weights: Weights) -> None:
    del weights["midlayer.hidden_norm.weight"]


def _flip_t2d(weights: Weights) -> None:
    weights["t2d"][1] = ~weights["t2d"][1]


@pytest.mark.parametrize(
    ("edit", "message"),
    [(_drop_hidden_norm, "hidden_norm"), (_flip_t2d, "t2d and d2t disagree")],
)
def test_a_head_that_does_not_fit_is_refused(
    edit: Callable[[Weights], None], message: str, tiny_model_dir: Path, vocab: int, tmp_path: Path
) -> None:
    head = write_head(tmp_path / "head", tiny_model_dir, list(range(0, vocab, 2)), edit=edit)
    embed = torch.nn.Embedding(vocab, HEAD_HIDDEN)
    with pytest.raises(ValueError, match=message):
        load_eagle3_head(
            str(head), embed, HEAD_HIDDEN, vocab, 64, torch.device("cpu"), torch.float32
        )


def test_a_pytorch_model_bin_loads_the_same(head_dir: Path, vocab: int, tmp_path: Path) -> None:
    """The EAGLE authors' heads ship pytorch_model.bin: the same tensors, the same head."""
    (tmp_path / "config.json").write_text((head_dir / "config.json").read_text())
    torch.save(load_file(str(head_dir / "model.safetensors")), tmp_path / "pytorch_model.bin")
    embed, cpu = torch.nn.Embedding(vocab, HEAD_HIDDEN), torch.device("cpu")
    heads = [
        load_eagle3_head(str(d), embed, HEAD_HIDDEN, vocab, 64, cpu, torch.float32)
        for d in (head_dir, tmp_path)
    ]
    assert torch.equal(heads[0].target_ids, heads[1].target_ids)
    for a, b in zip(heads[0].state_dict().values(), heads[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_equals_plain(
    batch: int, plain: LLMEngine, tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    engine = eagle3_engine(tiny_model_dir, head_dir)
    prompts = random_prompts(batch, (1, 30), vocab, seed=61)
    ks = [None, 0, 1, 2, 3, None][:batch]  # mixed k per request, including 0 (plain)
    seqs = engine.generate(prompts, [greedy(MAX_TOKENS, num_speculative_tokens=k) for k in ks])
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    drafted, _ = _drafted(seqs)
    assert drafted > 0
    # again, now from the prefix cache: the head reads the cached blocks' hidden states
    again = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in again] == [s.output_token_ids for s in seqs]
    assert _drafted(again)[0] > 0
    assert engine.block_manager.usage == 0.0


def test_greedy_with_chunked_prefill_and_preemption(
    plain: LLMEngine, tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    """Prompts in chunks of 9 tokens, and a pool too small for all four: requests are preempted
    and recomputed, and the head catches up on the recomputed positions' hidden states."""
    engine = eagle3_engine(tiny_model_dir, head_dir, num_kv_blocks=16, max_num_batched_tokens=9)
    prompts = random_prompts(4, (15, 30), vocab, seed=43)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"chunked-{i}", prompt, greedy(MAX_TOKENS))
    seqs, preempted = list(engine.seqs.values()), 0
    while engine.has_unfinished():
        engine.step()
        preempted += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert preempted > 0 and _drafted(seqs)[0] > 0
    assert engine.block_manager.num_free_blocks == 16


def test_greedy_json_is_the_same_and_valid(
    plain: LLMEngine, tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    """Under a grammar the head's rows are masked as the verify rows will be, and grammar-forced
    tokens (drafted for free, without the head) leave it positions to catch up on later."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    constraints = Constraints(grammar=grammar_from("json", schema))
    params = SamplingParams(max_tokens=60, temperature=0.0, constraints=constraints)
    engine = eagle3_engine(tiny_model_dir, head_dir, k=3)
    prompts = random_prompts(4, (3, 20), vocab, seed=67)
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, params)
    for seq in seqs:
        assert seq.finish_reason == "stop"
        json.loads(engine.tokenizer.decode(seq.output_token_ids))
    assert seqs[0].spec.by_proposer.get("eagle3", [0])[0] > 0


# ---- sampling ----------------------------------------------------------------------------------

TEMPERATURE = 1.5
NUM_SAMPLES = 2000


def _exact_pair_probs(model_dir: Path, prompt: list[int]) -> np.ndarray:
    """P(t1, t2) under the target at TEMPERATURE, exactly, from transformers' logits."""
    model = hf_model(model_dir)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / TEMPERATURE, -1)
        batch = torch.tensor([prompt + [t] for t in range(first.shape[0])])
        second = torch.softmax(model(batch).logits[:, -1] / TEMPERATURE, -1)
    return (first[:, None] * second).double().numpy()  # [vocab, vocab]


def test_sampled_pairs_follow_the_target_distribution(
    tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    """The head drafts t2 in the step after the prompt's (max_tokens 3 leaves room for one draft),
    so the pair (t1, t2) went through rejection sampling with the head's q."""
    prompt = random_prompts(1, (6, 6), vocab, seed=47)[0]
    engine = eagle3_engine(
        tiny_model_dir, head_dir, k=2, num_kv_blocks=4096, max_num_seqs=256,
        max_num_batched_tokens=8192,
    )  # fmt: skip
    params = [
        SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True)
        for _ in range(NUM_SAMPLES)
    ]
    seqs = engine.generate([prompt] * NUM_SAMPLES, params)
    pairs = [(s.output_token_ids[0], s.output_token_ids[1]) for s in seqs]
    drafted, accepted = _drafted(seqs)
    assert drafted >= NUM_SAMPLES and accepted > 0  # q overlaps p a little even for a random head
    assert len(set(pairs)) > 10
    assert chi_square_pvalue(pairs, _exact_pair_probs(tiny_model_dir, prompt)) > 1e-3


def test_seeded_text_is_the_same_with_the_head_on_and_off(
    plain: LLMEngine, tiny_model_dir: Path, head_dir: Path, vocab: int
) -> None:
    prompts = random_prompts(3, (4, 20), vocab, seed=83)
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, choice=c, ignore_eos=True)
        for c in range(3)
    ]
    off = [outputs(plain, [p], q)[0] for p, q in zip(prompts, params, strict=True)]
    engine = eagle3_engine(tiny_model_dir, head_dir, k=4)
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == off
    assert _drafted(seqs)[0] > 0


# ---- a head that copies its target -------------------------------------------------------------

CYCLE = list(range(40, 56))  # the bigram target maps each of these ids to the next, cyclically


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama target whose layers add nothing (o_proj and down_proj zero): its next token is
    g(t) = CYCLE's successor of the CYCLE id whose embedding (orthonormal ones) t leans on most."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("bigram"), family="llama", seed=2, tie_word_embeddings=False
    )
    file = path / "model.safetensors"
    weights = load_file(str(file))
    basis = _cycle_basis()
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
    weights["model.embed_tokens.weight"][CYCLE] = basis
    head = weights["lm_head.weight"].zero_()
    for i in range(len(CYCLE)):  # g(CYCLE[i]) = CYCLE[i + 1]
        head[CYCLE[(i + 1) % len(CYCLE)]] = 4.0 * basis[i]
    save_file(weights, str(file))
    return path


def _cycle_basis() -> torch.Tensor:  # [len(CYCLE), 64]: orthonormal rows
    q, _ = torch.linalg.qr(torch.randn(HEAD_HIDDEN, HEAD_HIDDEN, generator=torch.manual_seed(3)))
    return q[: len(CYCLE)].contiguous()


def _copy_head(weights: Weights) -> None:
    """The head at position i sees h_i = embed(t_i) (through fc; its own layer adds nothing) and
    must predict t_{i+2} = g(g(t_i)): lm_head row of CYCLE[i + 2] is the basis vector of
    CYCLE[i]. Only the first draft can be right: the next one sees the same h again."""
    h = HEAD_HIDDEN
    weights["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, 2 * h)], dim=1)
    for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        weights[name].zero_()
    weights["norm.weight"].fill_(1.0)
    draft_ids = (torch.arange(weights["d2t"].numel()) + weights["d2t"]).tolist()
    lm_head, basis = weights["lm_head.weight"].zero_(), _cycle_basis()
    for i in range(len(CYCLE)):
        lm_head[draft_ids.index(CYCLE[(i + 2) % len(CYCLE)])] = 4.0 * basis[i]


@pytest.mark.parametrize("k", [1, 3])
def test_a_copying_head_gets_its_first_draft_accepted(
    k: int, bigram_target: Path, tmp_path: Path
) -> None:
    vocab = hf_model(bigram_target).config.vocab_size
    draft_ids = sorted({*CYCLE, *range(0, vocab, 7)})
    head = write_head(tmp_path / "head", bigram_target, draft_ids, edit=_copy_head)
    engine = eagle3_engine(bigram_target, head, k=k)
    prompts = random_prompts(4, (3, 20), vocab, seed=71)
    seqs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in seqs] == outputs(
        make_engine(bigram_target), prompts, greedy(MAX_TOKENS)
    )
    assert all(t in CYCLE for s in seqs for t in s.output_token_ids)  # the target is the bigram
    for seq in seqs:  # the first draft of every drafting step, never a later one (no fixed point)
        assert seq.spec.num_drafts >= 4
        assert seq.spec.num_accepted_tokens == seq.spec.num_drafts
        assert seq.spec.accepted_per_pos[0] == seq.spec.num_drafts


def test_planned_drafts_stay_lossless_and_price_the_head(
    bigram_target: Path, tmp_path: Path
) -> None:
    """With the planner the head's forwards are measured into the draft's cost curve, and a head
    whose first draft is always right keeps drafting."""
    vocab = hf_model(bigram_target).config.vocab_size
    draft_ids = sorted({*CYCLE, *range(0, vocab, 7)})
    head = write_head(tmp_path / "head", bigram_target, draft_ids, edit=_copy_head)
    engine = eagle3_engine(bigram_target, head, k=3, adaptive=True)
    assert engine.costs.draft.known
    prompts = random_prompts(4, (3, 20), vocab, seed=73)
    seqs = engine.generate(prompts, greedy(24))
    assert [s.output_token_ids for s in seqs] == outputs(
        make_engine(bigram_target), prompts, greedy(24)
    )
    drafted, accepted = _drafted(seqs)
    assert accepted > 0 and drafted > 0
