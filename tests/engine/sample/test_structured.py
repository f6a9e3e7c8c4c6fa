"""Grammars and logit_bias stay exact under speculation (engine level, tiny models).

Greedy output under a JSON schema is the same with and without drafts (draft model and n-gram,
k up to 6) and validates against the schema; drafts that break the grammar (fuzzed) never reach
the output; sampling under a mask keeps the masked target distribution; logit_bias bans and forces.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
import torch
from engine_utils import (
    chi_square_pvalue,
    greedy,
    hf_model,
    make_engine,
    outputs,
    random_prompts,
)
from server_utils import real_server
from tiny import build_tiny_tokenizer
from transformers import AutoTokenizer

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample import structured
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import Constraints, grammar_from
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers import Proposal

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def spec_engine(kind: str, model: Path, draft: Path, k: int, **overrides: object) -> LLMEngine:
    if kind == "ngram":
        spec = SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, ngram_min=1, ngram_max=3, adaptive=False
        )
    else:  # draft or hybrid (an n-gram match where there is one, else the draft model)
        spec = SpeculativeConfig(
            method=kind,
            num_speculative_tokens=k,
            adaptive=False,
            draft_model=str(draft),  # type: ignore[arg-type]
        )
    return make_engine(model, speculative=spec, **overrides)


def json_params(max_tokens: int = MAX_TOKENS, **kw: object) -> SamplingParams:
    constraints = Constraints(grammar=grammar_from("json", SCHEMA))
    kw = {"temperature": 0.0} | kw
    return SamplingParams(max_tokens=max_tokens, constraints=constraints, **kw)  # type: ignore[arg-type]


def assert_valid_json(tokenizer: object, token_ids: list[int]) -> None:
    text = tokenizer.decode(token_ids)  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(text), SCHEMA)


# ---- greedy: identical with and without speculation, always valid ---------------------------


@pytest.mark.parametrize(
    ("kind", "k"), [("draft", 2), ("draft", 6), ("ngram", 3), ("ngram", 6), ("hybrid", 4)]
)
def test_greedy_json_identical_with_speculation(
    kind: str,
    k: int,
    plain: LLMEngine,
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
    tokenizer: object,
    vocab: int,
) -> None:
    engine = spec_engine(kind, tiny_model_dir, tiny_draft_dir, k)
    prompts = random_prompts(6, (3, 20), vocab, seed=61)
    seqs = engine.generate(prompts, json_params())
    reference = plain.generate(prompts, json_params())
    assert [s.output_token_ids for s in seqs] == [s.output_token_ids for s in reference]
    for seq in seqs:
        assert seq.finish_reason == "stop", tokenizer.decode(seq.output_token_ids)  # type: ignore[attr-defined]
        assert_valid_json(tokenizer, seq.output_token_ids)
    assert sum(s.spec.num_draft_tokens for s in seqs) > 0
    assert engine.block_manager.usage == 0.0


def test_constrained_and_free_requests_share_a_batch(
    plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    engine = spec_engine("draft", tiny_model_dir, tiny_draft_dir, 4)
    prompts = random_prompts(4, (3, 20), vocab, seed=67)
    params = [json_params(), greedy(16), json_params(), greedy(16)]
    mixed = outputs(engine, prompts, params)
    alone = [outputs(plain, [p], q)[0] for p, q in zip(prompts, params, strict=True)]
    assert mixed == alone


# ---- fuzzed drafts: grammar-breaking proposals never reach the output ------------------------


class FuzzProposer:
    """Random drafts (often illegal under the grammar), with random draft distributions."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        return [self._one(item) for item in batch]

    def _one(self, item: ScheduledSeq) -> Proposal:
        k = min(item.num_spec_tokens, self.rng.randint(0, 6))
        if k == 0:
            return Proposal.empty()
        legal = structured.forced_tokens(
            item.seq.constraint, k
        )  # sometimes propose the right thing
        drafts = [legal[i] if i < len(legal) and self.rng.random() < 0.5 else self.rng.randrange(self.vocab) for i in range(k)]  # fmt: skip
        gen = torch.Generator().manual_seed(self.rng.randrange(1 << 30))
        probs = torch.rand((k, self.vocab), generator=gen)
        probs[torch.arange(k), drafts] += 1.0
        return Proposal(drafts, probs / probs.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fuzzed_drafts_never_break_the_grammar(
    temperature: float, plain: LLMEngine, tiny_model_dir: Path, tokenizer: object, vocab: int
) -> None:
    spec = SpeculativeConfig(
        method="ngram", num_speculative_tokens=6, ngram_min=1, ngram_max=3, adaptive=False
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    engine.proposer = FuzzProposer(vocab, seed=71)
    prompts = random_prompts(8, (3, 20), vocab, seed=73)
    params = [json_params(temperature=temperature, seed=i) for i in range(len(prompts))]
    seqs = engine.generate(prompts, params)
    for seq in seqs:
        assert seq.finish_reason == "stop"
        assert_valid_json(tokenizer, seq.output_token_ids)
    assert sum(s.spec.num_draft_tokens for s in seqs) > 0
    if temperature == 0.0:
        assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, params)


# ---- sampling under a mask keeps the masked target distribution ------------------------------

TEMPERATURE = 1.5
NUM_SAMPLES = 1500
LETTERS = grammar_from("regex", "[a-z ]{40,60}")  # EOS stays illegal for the first tokens


def exact_masked_pairs(model_dir: Path, tokenizer: object, prompt: list[int]) -> np.ndarray:
    """P(t1, t2) at TEMPERATURE under the grammar's masks, from transformers' logits."""
    model = hf_model(model_dir)
    state = structured.new_state(Constraints(grammar=LETTERS), tokenizer)
    assert state is not None and state.matcher is not None
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1:]  # [1, V]
        masked = structured.apply_bitmask(
            logits,
            structured.fill_bitmasks(state.matcher, [], 1, state.matcher_vocab),
            len(tokenizer),  # type: ignore[arg-type]
        )
        first = torch.softmax(masked[0] / TEMPERATURE, -1)
        vocab = first.shape[0]
        probs = torch.zeros((vocab, vocab), dtype=torch.float64)
        for t1 in first.nonzero().flatten().tolist():
            row = model(torch.tensor([prompt + [t1]])).logits[0, -1:]
            mask = structured.fill_bitmasks(state.matcher, [t1], 2, state.matcher_vocab)[1:]
            second = torch.softmax(structured.apply_bitmask(row, mask, vocab)[0] / TEMPERATURE, -1)
            probs[t1] = first[t1].double() * second.double()
    return probs.numpy()


@pytest.mark.parametrize("kind", ["none", "draft", "ngram"])
def test_sampled_pairs_follow_the_masked_distribution(
    kind: str, tiny_model_dir: Path, tiny_draft_dir: Path, tokenizer: object, vocab: int
) -> None:
    prompt = tokenizer.encode("the quick brown fox the quick brown")  # type: ignore[attr-defined]
    big = dict(num_kv_blocks=4096, max_num_seqs=256, max_num_batched_tokens=8192)
    engine = (
        make_engine(tiny_model_dir, **big)
        if kind == "none"
        else spec_engine(kind, tiny_model_dir, tiny_draft_dir, 2, **big)
    )
    params = [
        SamplingParams(
            max_tokens=2,
            temperature=TEMPERATURE,
            seed=s,
            ignore_eos=True,
            constraints=Constraints(grammar=LETTERS),
        )  # fmt: skip
        for s in range(NUM_SAMPLES)
    ]
    seqs = engine.generate([prompt] * NUM_SAMPLES, params)
    pairs = [(s.output_token_ids[0], s.output_token_ids[1]) for s in seqs]
    assert (sum(s.spec.num_draft_tokens for s in seqs) > 0) == (kind != "none")
    assert len(set(pairs)) > 10
    probs = exact_masked_pairs(tiny_model_dir, tokenizer, prompt)
    assert all(probs[t1, t2] > 0 for t1, t2 in pairs)  # nothing outside the mask, ever
    assert chi_square_pvalue(pairs, probs, max_cells=150) > 1e-3


def test_draft_rows_with_nothing_to_propose_stop_drafting(
    tiny_model_dir: Path, tokenizer: object, vocab: int
) -> None:
    """A draft head limited below every token the grammar allows (draft_vocab_size) leaves the
    draft's rows nothing to propose: those requests sample on without drafts (no NaN from an
    all -inf row), inside the grammar, while a free request in the same batch drafts."""
    allowed = set("abcdefghijklmnopqrstuvwxyz ")
    letters = [i for i in range(vocab) if set(tokenizer.decode([i]) or "?") <= allowed]  # type: ignore[attr-defined]
    spec = SpeculativeConfig(
        method="draft",
        num_speculative_tokens=2,
        adaptive=False,
        draft_model=str(tiny_model_dir),
        draft_vocab_size=min(letters),
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    sampled = dict(max_tokens=8, temperature=TEMPERATURE, ignore_eos=True)
    params = [
        SamplingParams(seed=s, constraints=Constraints(grammar=LETTERS), **sampled)  # type: ignore[arg-type]
        for s in range(6)
    ]
    params.append(SamplingParams(seed=99, **sampled))  # type: ignore[arg-type]
    prompt = tokenizer.encode("the quick brown fox")  # type: ignore[attr-defined]
    seqs = engine.generate([prompt] * len(params), params)
    for seq in seqs[:-1]:
        assert re.fullmatch("[a-z ]{8,}", tokenizer.decode(seq.output_token_ids))  # type: ignore[attr-defined]
        assert seq.spec.num_draft_tokens == 0
    assert seqs[-1].spec.num_draft_tokens > 0


# ---- logit_bias ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "draft", "ngram"])
def test_logit_bias_bans_and_forces(
    kind: str, plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    engine = plain if kind == "none" else spec_engine(kind, tiny_model_dir, tiny_draft_dir, 4)
    prompts = random_prompts(4, (3, 20), vocab, seed=79)
    free = outputs(plain, prompts, greedy(12))
    banned = sorted({t for out in free for t in out})
    ban = Constraints(logit_bias=tuple((t, -100.0) for t in banned))
    for out in outputs(engine, prompts, greedy(12, constraints=ban)):
        assert not set(out) & set(banned)
    forced = banned[0]
    force = Constraints(logit_bias=((forced, 100.0),))
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True, constraints=force)  # fmt: skip
        for out in outputs(engine, prompts, params):
            assert out == [forced] * 12


def test_logit_bias_ids_out_of_range_are_refused(plain: LLMEngine, vocab: int) -> None:
    bad = Constraints(logit_bias=((vocab, 1.0),))
    with pytest.raises(ValueError, match="logit_bias"):
        plain.validate([1, 2], SamplingParams(constraints=bad))


# ---- masks themselves ------------------------------------------------------------------------


def test_padding_rows_are_always_masked(tokenizer: object) -> None:
    state = structured.new_state(Constraints(grammar=grammar_from("regex", ".*")), tokenizer)
    assert state is not None and state.matcher is not None
    width = len(tokenizer) + 37  # type: ignore[arg-type]
    bitmask = torch.full((1, (width + 31) // 32), -1, dtype=torch.int32)
    allowed = structured.allowed_tokens(bitmask, width, state.vocab_size)
    assert allowed[0, : state.vocab_size].all() and not allowed[0, state.vocab_size :].any()


def test_masks_follow_the_drafts_and_roll_back(tokenizer: object) -> None:
    state = structured.new_state(Constraints(grammar=grammar_from("choice", ["yes", "no"])), tokenizer)  # fmt: skip
    assert state is not None and state.matcher is not None
    yes = tokenizer.encode("yes")  # type: ignore[attr-defined]
    bad = tokenizer.encode("x")[0]  # type: ignore[attr-defined]
    masks = structured.fill_bitmasks(state.matcher, [*yes, bad], len(yes) + 2, state.matcher_vocab)
    allowed = structured.allowed_tokens(masks, len(tokenizer), state.vocab_size)  # type: ignore[arg-type]
    for i, token in enumerate(yes):
        assert allowed[i, token]
    assert not allowed[len(yes), bad]
    assert torch.equal(allowed[-1], allowed[-2])  # past the refused draft: a copy, never empty
    assert structured.cut_drafts(state, [*yes, bad]) == yes
    assert state.matcher.validate_tokens(yes) == len(yes)  # rolled back to the start


# ---- through the API (live server, n-gram speculation, openai SDK) ---------------------------


@pytest.fixture(scope="module")
def client(tiny_model_dir: Path) -> Iterator[openai.OpenAI]:
    with real_server(tiny_model_dir, num_speculative_tokens=4) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)


MESSAGES: list[Any] = [{"role": "user", "content": "Give me a person as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}  # fmt: skip


def test_chat_json_schema_validates_and_streams_the_same(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    r = client.chat.completions.create(response_format=RESPONSE_FORMAT, **kw)  # type: ignore[arg-type]
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    content = choice.message.content
    assert content is not None
    jsonschema.validate(json.loads(content), SCHEMA)
    chunks = client.chat.completions.create(response_format=RESPONSE_FORMAT, stream=True, **kw)  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert free != content  # the grammar really changed the output


@pytest.mark.parametrize("seed", range(4))
def test_sampled_json_schema_outputs_all_validate(client: openai.OpenAI, seed: int) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=3,
        response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_json_object(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="tiny", prompt="JSON:", max_tokens=200, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")


def test_guided_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    def complete(**extra: Any) -> str:
        r = client.completions.create(
            model="tiny", prompt="Answer:", max_tokens=40, temperature=0.8, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].text

    assert re.fullmatch(r"\d{3}-[a-z]{2}", complete(guided_regex=r"\d{3}-[a-z]{2}"))
    for _ in range(3):
        assert complete(guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", complete(guided_grammar=lark))
    text = complete(guided_json={"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"], "additionalProperties": False})  # fmt: skip
    assert json.loads(text)["k"] in (1, 2)


def test_logit_bias_through_the_api(client: openai.OpenAI) -> None:
    tokens = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=1.0,
        logit_bias={"300": 100}, extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    assert tokens == [300] * 8
    free = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    banned = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0,
        logit_bias={str(t): -100 for t in free},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0].model_extra["token_ids"]  # fmt: skip
    assert not set(banned) & set(free)


def test_gguf_padding_tokens_are_masked(tmp_path: Path) -> None:
    """A converted GGUF vocabulary ends in `[PAD<id>]` text tokens: never allowed, even where
    the grammar would take their text."""
    tokenizer = build_tiny_tokenizer(tmp_path)
    real = len(tokenizer)
    tokenizer.add_tokens([f"[PAD{i}]" for i in range(real, real + 12)])
    assert structured.real_vocab_size(tokenizer) == real
    state = structured.new_state(Constraints(grammar=grammar_from("regex", r"[\[\]A-Z0-9]*")), tokenizer)  # fmt: skip
    assert state is not None and state.matcher is not None
    logits = torch.zeros((1, len(tokenizer) + 20))
    rows = structured.constrain_rows(state, logits, [])
    assert torch.isinf(rows[0, real:]).all() and torch.isfinite(rows[0, :real]).any()
    bias_only = structured.new_state(Constraints(logit_bias=((5, 1.0),)), tokenizer)
    rows = structured.constrain_rows(bias_only, logits, [])
    assert torch.isinf(rows[0, real:]).all() and rows[0, 5] == 1.0


# ---- grammar-forced tokens are free drafts ---------------------------------------------------

FORCING = {
    "type": "object",
    "properties": {
        "a_rather_long_property_name": {"const": "the only value it may take"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "another_fixed_key": {"enum": ["yes indeed"]},
    },
    "required": ["a_rather_long_property_name", "n", "another_fixed_key"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("kind", ["draft", "ngram", "hybrid"])
def test_forced_tokens_are_drafted_and_stay_exact(
    kind: str, plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    engine = spec_engine(kind, tiny_model_dir, tiny_draft_dir, 6)
    prompts = random_prompts(4, (3, 20), vocab, seed=83)
    constraints = Constraints(grammar=grammar_from("json", FORCING))
    params = SamplingParams(max_tokens=80, temperature=0.0, constraints=constraints)
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, params)
    for seq in seqs:
        assert seq.finish_reason == "stop"
        # Most of the output is forced: drafted (as the grammar's) and accepted, few steps.
        assert seq.spec.num_accepted_tokens >= seq.num_output_tokens // 2
        assert seq.spec.by_proposer["grammar"][1] >= seq.num_output_tokens // 3
    sampled = SamplingParams(max_tokens=80, temperature=1.0, seed=5, constraints=constraints)
    for seq in engine.generate(prompts, sampled):
        assert json.loads(engine.tokenizer.decode(seq.output_token_ids))["n"] in range(10)


def test_forced_drafts_do_not_wait_for_the_speculation_policy(
    plain: LLMEngine, tiny_model_dir: Path, tiny_draft_dir: Path, vocab: int
) -> None:
    """A step where the policy speculates nothing still drafts what the grammar forces."""
    engine = spec_engine("draft", tiny_model_dir, tiny_draft_dir, 6)
    engine.scheduler._step_k = lambda: 0  # type: ignore[method-assign]
    prompts = random_prompts(3, (3, 20), vocab, seed=89)
    constraints = Constraints(grammar=grammar_from("json", FORCING))
    params = SamplingParams(max_tokens=80, temperature=0.0, constraints=constraints)
    seqs = engine.generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, params)
    for seq in seqs:
        assert set(seq.spec.by_proposer) == {"grammar"}
        assert seq.spec.by_proposer["grammar"][1] >= seq.num_output_tokens // 3
