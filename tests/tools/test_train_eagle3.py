"""tools.train_eagle3 end to end on the tiny target: a few seconds of training on a few hundred
tokens of the repo's docs give a head in the public format that the engine loads and drafts with.

Checked: the loss on the training data falls (seeded, so it either does or the test fails); the
same seed gives the same losses; the saved folder loads through engine/model/eagle3.py and gives
the training module's logits, at step 0 and at an unrolled step (the training-time test's
attention is the drafting's); and greedy output with the head equals plain decoding.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_utils import greedy, hf_model, make_engine, outputs, random_prompts
from safetensors.torch import load_file

from engine.config import SpeculativeConfig
from engine.model.eagle3 import Eagle3Head, load_eagle3_head
from engine.model.head_kv import HeadSpan
from engine.sample.sampling_params import SamplingParams
from tools.eagle3_data import UNKNOWN, captured_answers, extract_features
from tools.train_eagle3 import (
    Recipe,
    Result,
    head_config,
    head_step,
    lr_factor,
    run,
    save_head,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"


def recipe(target: Path, out: Path, steps: int) -> Recipe:
    return Recipe(
        target=str(target),
        out=str(out),
        seed=0,
        sources=(str(DOCS / "SAMPLING.md"), str(DOCS / "ARCHITECTURE.md")),
        tokens=512,
        seq_len=64,
        batch=4,
        steps=steps,
        lr=3e-3,
        ttt_steps=2,
        draft_vocab=160,
        aux_layers=(0, 1, 2),  # the tiny target has two layers: 2 is its last output
        log_every=10,
        save_dtype="float32",
    )


@pytest.fixture(scope="module")
def trained(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Eagle3Head, Result]:
    out = tmp_path_factory.mktemp("head")
    head, result = run(recipe(tiny_model_dir, out, steps=40))
    return out, head, result


def test_training_lowers_the_loss(trained: tuple[Path, Eagle3Head, Result]) -> None:
    folder, _, result = trained
    assert len(result.losses) == 40
    assert result.last_eval < 0.8 * result.first_eval, (result.first_eval, result.last_eval)
    readme = json.loads((folder / "README.json").read_text())
    assert readme["recipe"]["seed"] == 0 and readme["steps"] == 40 and readme["tokens"] == 512


def test_same_seed_same_losses(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = run(recipe(tiny_model_dir, tmp_path / "a", steps=3))[1].losses
    second = run(recipe(tiny_model_dir, tmp_path / "b", steps=3))[1].losses
    assert first == second


def test_saved_head_gives_the_training_logits(
    trained: tuple[Path, Eagle3Head, Result], tiny_model_dir: Path
) -> None:
    folder, head, _ = trained
    model = hf_model(tiny_model_dir)
    tokens = torch.randint(
        3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1)
    )
    aux = extract_features(model, tokens, (0, 1, 2), batch=1).aux.float()  # [1, 24, 3 * hidden]
    loaded = load_eagle3_head(
        str(folder),
        head.target_embed[0],  # the embedding it trained with: the target's, in bf16
        64,
        model.config.vocab_size,
        256,
        torch.device("cpu"),
        torch.float32,
    )
    m = 10  # the row compared at the unrolled step
    nxt = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # [1, 24]: row i reads t_{i+1}
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        train0, prenorm = head_step(head, head.fuse(aux), nxt, 0, kv)
        step2 = torch.cat([nxt[:, 1:], nxt[:, :1]], dim=1)
        train1, _ = head_step(head, prenorm, step2, 1, kv)
        cache = loaded.new_cache()
        normed, own = loaded(
            loaded.fuse(aux[0, : m + 1]), nxt[0, : m + 1], [HeadSpan(cache, 0, m + 1)]
        )
        serve0 = loaded.logits(normed)[:, loaded.target_ids]  # [m + 1, draft]
        normed, _ = loaded(own[-1:], step2[0, m : m + 1], [HeadSpan(cache, m + 1, 1)])
        serve1 = loaded.logits(normed)[:, loaded.target_ids]  # [1, draft]
    torch.testing.assert_close(serve0, train0[0, : m + 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(serve1, train1[0, m : m + 1], rtol=1e-4, atol=1e-4)


def test_engine_with_trained_head_equals_plain(
    trained: tuple[Path, Eagle3Head, Result], tiny_model_dir: Path
) -> None:
    folder = trained[0]
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, draft_model=str(folder))
    engine = make_engine(tiny_model_dir, speculative=spec)
    prompts = random_prompts(4, (5, 20), hf_model(tiny_model_dir).config.vocab_size, seed=3)
    want = outputs(make_engine(tiny_model_dir), prompts, greedy(16))
    seqs = engine.generate(prompts, greedy(16))
    assert [s.output_token_ids for s in seqs] == want
    assert sum(s.spec.num_draft_tokens for s in seqs) > 0  # the head drafted


def test_head_config_keeps_the_targets_rope() -> None:
    """transformers 5 keeps rope_theta in rope_parameters; the format wants it at the top."""
    target = {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "vocab_size": 151936,
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    }
    config = head_config(target, recipe(Path("t"), Path("o"), 1), (2, 14, 25), 8192)
    assert config["rope_theta"] == 1e6 and config["head_dim"] == 128
    assert config["intermediate_size"] == 8960 and config["draft_vocab_size"] == 8192


def test_an_int8_head_loads_close_to_its_float_one_and_is_checked(
    trained: tuple[Path, Eagle3Head, Result], tmp_path: Path
) -> None:
    """`--save-dtype int8` halves the file (int8 rows and a float scale each); the loader
    dequantizes, and a SHA256SUMS beside the files must match them."""
    folder, head, _ = trained
    packed = tmp_path / "int8"
    packed.mkdir()
    (packed / "config.json").write_text((folder / "config.json").read_text())
    draft_ids = load_eagle3_head(
        str(folder), head.target_embed[0], 64, head.config.vocab_size, 256,
        torch.device("cpu"), torch.float32,
    ).target_ids  # fmt: skip
    save_head(head, packed, draft_ids, "int8")
    weights = load_file(str(packed / "model.safetensors"))
    assert weights["fc.weight"].dtype == torch.int8 and "fc.weight_scale" in weights
    loaded = load_eagle3_head(
        str(packed), head.target_embed[0], 64, head.config.vocab_size, 256,
        torch.device("cpu"), torch.float32,
    )  # fmt: skip
    for name, want in head.state_dict().items():
        if name.endswith(".weight") and want.dim() == 2 and name != "embed_tokens.weight":
            got, want = loaded.state_dict()[name], want.bfloat16().float()  # int8 of the bf16
            step = want.abs().amax(dim=1, keepdim=True) / 127  # one int8 step per row
            assert ((got - want).abs() <= step * 0.501).all(), name
    (packed / "config.json").write_text((folder / "config.json").read_text() + " ")
    with pytest.raises(ValueError, match="sha256"):
        load_eagle3_head(
            str(packed), head.target_embed[0], 64, head.config.vocab_size, 256,
            torch.device("cpu"), torch.float32,
        )  # fmt: skip


def test_answers_are_the_targets_greedy_text_and_kept_for_a_rerun(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--answers N`: the engine answers N training prompts greedily (prompt ids, then its own
    tokens), and the answers are kept beside the features' cache for the next run."""
    import tools.train_eagle3 as train
    from bench.serving.datasets import Prompt

    prompts = [Prompt("code", "a", prompt="def add(a, b):"), Prompt("code", "b", prompt="x = [")]
    monkeypatch.setattr(train, "training_prompts", lambda count, seed: prompts[:count])
    base = recipe(tiny_model_dir, tmp_path / "out", steps=1)
    r = replace(base, answers=2, answer_tokens=5, dtype="float32")
    cache = tmp_path / "features.pt"
    answers = train.answered(r, cache)
    engine = make_engine(tiny_model_dir)
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = list(engine.tokenizer.encode(prompt.prompt))
        assert answer[: len(ids)] == ids and len(answer) == len(ids) + 5
        assert answer[len(ids) :] == outputs(engine, [ids], greedy(5))[0]
    monkeypatch.setattr(train, "target_answers", None)  # a rerun must not generate again
    assert train.answered(r, cache) == answers


def test_captured_answers_are_the_teacher_forced_features(
    trained: tuple[Path, Eagle3Head, Result], tiny_model_dir: Path
) -> None:
    """What `captured_answers` keeps while an EAGLE-3 engine answers: the requests' tokens packed
    in order; the pick after each answer position is the answer's next token (the prompt's are
    UNKNOWN); the aux streams equal a teacher-forced forward over the request's own tokens."""
    spec = SpeculativeConfig(method="eagle3", num_speculative_tokens=3, draft_model=str(trained[0]))
    engine = make_engine(tiny_model_dir, speculative=spec)
    model = hf_model(tiny_model_dir)
    prompts = random_prompts(3, (5, 12), model.config.vocab_size, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    answers = outputs(make_engine(tiny_model_dir), prompts, params)
    data = captured_answers(engine, prompts, max_tokens=20, seq_len=8)
    streams = [(p + a)[:-1] for p, a in zip(prompts, answers, strict=True)]  # computed positions
    picks = [[UNKNOWN] * (len(p) - 1) + a for p, a in zip(prompts, answers, strict=True)]
    cut = data.tokens.numel()
    assert cut == sum(map(len, streams)) // 8 * 8
    assert data.tokens.flatten().tolist() == [t for s in streams for t in s][:cut]
    assert data.greedy.flatten().tolist() == [t for p in picks for t in p][:cut]
    first = torch.tensor(streams[0])[None]  # [1, n]
    reference = extract_features(model, first, (0, 1, 2), batch=1)
    assert reference.greedy[0, len(prompts[0]) - 1 :].tolist() == answers[0]
    torch.testing.assert_close(
        data.aux.flatten(0, 1)[: first.shape[1]].float(),
        reference.aux[0].float(),
        rtol=2e-2,
        atol=2e-2,  # both kept in bfloat16
    )


def test_the_learning_rate_warms_up_then_falls_to_zero_at_the_step_budget() -> None:
    linear = recipe(Path("t"), Path("o"), steps=100)
    constant = replace(linear, schedule="constant")
    assert lr_factor(0, linear) == pytest.approx(1 / 20)
    assert lr_factor(50, linear) == pytest.approx(0.5) and lr_factor(50, constant) == 1.0
    assert lr_factor(100, linear) == 0.0 and lr_factor(99, linear) > 0.0


def test_chat_features_come_in_parts_each_cached(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--chat-prompts N` answers the chat set in parts of `--chat-part` requests, each packed and
    cached on its own: a cache of the first parts serves a recipe that asks for more, and only
    the missing parts are answered."""
    import bench.serving.peers
    import tools.train_eagle3 as train
    from tools.eagle3_data import Features

    answered: list[list[int]] = []

    def chunks(ids: list[int]) -> Features:  # one chunk of one token per request
        tokens = torch.tensor(ids, dtype=torch.long).reshape(-1, 1)
        return Features(tokens, torch.zeros(len(ids), 1, 3), tokens)

    def answer(engine: object, prompts: list[list[int]], max_tokens: int, seq_len: int) -> Features:
        answered.append([p[0] for p in prompts])
        return chunks(answered[-1])

    monkeypatch.setattr(train, "captured_answers", answer)
    monkeypatch.setattr(train, "answering_engine", lambda recipe, layers: engine)
    monkeypatch.setattr(train, "text_features", lambda *args: chunks([]))
    index = {p.prompt_id: i for i, p in enumerate(train.chat_prompts(6, 0))}
    monkeypatch.setattr(bench.serving.peers, "prompt_ids", lambda tok, p: [index[p.prompt_id]])
    engine = type("Engine", (), {"tokenizer": None})()
    base = replace(recipe(tiny_model_dir, tmp_path / "out", steps=1), cache=str(tmp_path / "f.pt"))
    two = train.features(replace(base, chat_prompts=4, chat_part=2), None, (0, 1, 2))  # type: ignore[arg-type]
    assert len(answered) == 2 and [len(a) for a in answered] == [2, 2]
    assert (tmp_path / "f.chat.pt").exists() and (tmp_path / "f.chat1.pt").exists()
    three = train.features(replace(base, chat_prompts=6, chat_part=2), None, (0, 1, 2))  # type: ignore[arg-type]
    assert answered == [[0, 1], [2, 3], [4, 5]]  # only the third part was answered again
    assert three.tokens.flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert torch.equal(three.tokens[:4], two.tokens)
