"""Each emitted token's origin (`SamplingParams.token_origins`): the accepted drafts carry their
proposer's name, the target's own tokens "target"; the spans' texts add up to the output text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_utils import make_engine
from transformers import AutoTokenizer

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.outputs import TARGET, RequestOutput, TokenSpan
from engine.sample.detokenizer import IncrementalDetokenizer
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import Constraints, grammar_from

REPEAT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy"
SCHEMA = {  # two fixed keys, a fixed value: most of the answer is forced by the grammar
    "type": "object",
    "properties": {
        "answer_in_one_word": {"type": "string", "maxLength": 12},
        "confidence": {"const": "high"},
    },
    "required": ["answer_in_one_word", "confidence"],
    "additionalProperties": False,
}


def engine_for(model: Path, draft: Path, method: str) -> LLMEngine:
    """The target drafting for itself accepts nearly every draft: the tiny random model's text
    rarely repeats, so an n-gram lookup alone is seldom right."""
    spec = SpeculativeConfig(
        method=method,  # type: ignore[arg-type]
        num_speculative_tokens=4,
        adaptive=False,
        ngram_min=1,
        ngram_max=3,
        draft_model=str(draft) if method in ("draft", "hybrid") else None,
    )
    return make_engine(model, speculative=spec)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, in order."""
    engine.add_request("r", prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += [out for out in engine.step() if out.request_id == "r"]
    return outputs


def spans_of(outputs: list[RequestOutput]) -> list[TokenSpan]:
    return [span for out in outputs for span in out.new_token_spans or []]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "hybrid"])
def test_spans_add_up_and_count_the_accepted_drafts(
    tiny_model_dir: Path, tokenizer: Any, method: str
) -> None:
    engine = engine_for(tiny_model_dir, tiny_model_dir, method)
    prompt = tokenizer.encode(REPEAT)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, token_origins=True)
    outputs = run(engine, prompt, params)
    spans = spans_of(outputs)
    for out in outputs:
        assert out.new_token_spans is not None
        assert "".join(s.text for s in out.new_token_spans) == out.new_text
        assert len(out.new_token_spans) == len(out.new_token_ids)
    spec = outputs[-1].spec
    drafted = [s for s in spans if s.origin != TARGET]
    assert len(spans) == 40
    assert len(drafted) == spec.num_accepted_tokens, "each accepted draft is one non-target span"
    expected = {"none": set(), "ngram": {"ngram"}, "draft": {"draft"}, "hybrid": {"ngram", "draft"}}
    assert {s.origin for s in drafted} <= expected[method]
    for name, (_, accepted) in spec.by_proposer.items():
        assert sum(s.origin == name for s in spans) == accepted
    if method in ("draft", "hybrid"):
        assert sum(s.origin == "draft" for s in spans) > 10, "the self-draft is mostly accepted"
    # speculation never changes what is produced: plain decoding gives the same text
    plain = run(engine_for(tiny_model_dir, tiny_model_dir, "none"), prompt, params)
    assert "".join(s.text for s in spans) == "".join(out.new_text for out in plain)


def test_grammar_forced_tokens_are_marked(tiny_model_dir: Path, tokenizer: Any) -> None:
    engine = engine_for(tiny_model_dir, tiny_model_dir, "ngram")  # forced drafts need k > 0
    constraints = Constraints(grammar=grammar_from("json", SCHEMA))
    params = SamplingParams(
        max_tokens=60, temperature=0.0, constraints=constraints, token_origins=True
    )
    spans = spans_of(run(engine, tokenizer.encode("Answer in JSON:"), params))
    forced = "".join(s.text for s in spans if s.origin == "grammar")
    assert {s.origin for s in spans} <= {"grammar", "ngram", TARGET}
    text = "".join(s.text for s in spans)
    assert json.loads(text)["confidence"] == "high"
    # each verify ends in the target's own token, so the forced runs come with gaps
    assert len(forced) >= len(text) // 2, f"most of {text!r} is forced, not {forced!r}"


def test_a_stop_string_cuts_the_spans_with_the_text(tiny_model_dir: Path, tokenizer: Any) -> None:
    engine = engine_for(tiny_model_dir, tiny_model_dir, "ngram")
    prompt = tokenizer.encode(REPEAT)
    free = run(engine, prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    text = "".join(out.new_text for out in free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"a visible stop string in {text!r}"
    params = SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,), token_origins=True
    )
    outputs = run(engine, prompt, params)
    assert "".join(s.text for s in spans_of(outputs)) == "".join(o.new_text for o in outputs)
    assert outputs[-1].finish_reason == "stop"


def test_without_the_flag_no_spans_are_kept(tiny_model_dir: Path, tokenizer: Any) -> None:
    engine = engine_for(tiny_model_dir, tiny_model_dir, "ngram")
    outputs = run(engine, tokenizer.encode(REPEAT), SamplingParams(max_tokens=8, temperature=0.0))
    assert all(out.new_token_spans is None for out in outputs)


def test_token_texts_on_a_character_split_over_tokens(tokenizer: Any) -> None:
    """A byte-level character spread over several tokens: the tokens before the one that completes
    it get "", that one the whole character."""
    ids = tokenizer.encode("ok 🦊 fox")
    detok = IncrementalDetokenizer(tokenizer, [], (), True, track_tokens=True)
    for token in ids:
        detok.append(token)
    text = detok.pop_delta(finished=True)
    pieces = detok.token_texts(0, text, 0)
    assert len(pieces) == len(ids) and "".join(pieces) == text == "ok 🦊 fox"
    assert "🦊" in pieces or " 🦊" in pieces
    assert "" in pieces, "the fox's first bytes complete no character"
