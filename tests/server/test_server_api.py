"""The OpenAI API on a live server (real engine, tiny model, n-gram speculation), through the
official `openai` SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_utils import RealServer, real_server

API_KEY = "test-key"
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
MESSAGES: list[Any] = [{"role": "user", "content": "Hello, world! How are you today?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RealServer]:
    with real_server(tiny_model_dir, api_key=API_KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(server: RealServer) -> Any:
    return server.engine.tokenizer


def greedy(ignore_eos: bool = False, **kw: Any) -> dict[str, Any]:
    """Greedy request arguments; our own fields travel in `extra_body`, as SDK users send them."""
    extra = {"ignore_eos": True} if ignore_eos else {}
    return {"model": "tiny", "temperature": 0, "max_tokens": 12, "extra_body": extra} | kw


def spec(obj: Any) -> dict[str, Any]:
    extra = obj.model_extra or {}
    assert "spec_decode" in extra, "every response carries its speculative summary"
    return dict(extra["spec_decode"])


# ---------------------------------------------------------------------------- completions


def test_completion_shape_and_usage(client: openai.OpenAI, tokenizer: Any) -> None:
    r = client.completions.create(prompt=PROMPT, **greedy(max_tokens=10, ignore_eos=True))
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    summary = spec(r)
    assert set(summary) == {
        "num_drafts", "drafted_tokens", "accepted_tokens", "acceptance_rate",
        "mean_acceptance_length",
    }  # fmt: skip
    assert summary["drafted_tokens"] > 0, "the repetitive prompt gives the n-gram proposer drafts"
    assert summary["acceptance_rate"] == pytest.approx(
        summary["accepted_tokens"] / summary["drafted_tokens"]
    )
    assert spec(choice) == summary


def test_prompt_forms_agree(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(prompt=PROMPT, **greedy())
    by_ids = client.completions.create(prompt=ids, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(prompt=[PROMPT, "Hello, world!"], **greedy())
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    id_batch = client.completions.create(
        prompt=[ids, tokenizer.encode("Hello, world!")], **greedy()
    )
    assert [c.text for c in id_batch.choices] == [c.text for c in batch.choices]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hello, world!"))


def test_stream_concatenates_to_the_non_streamed_text(client: openai.OpenAI) -> None:
    full = client.completions.create(prompt=PROMPT, **greedy(max_tokens=24))
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **greedy(max_tokens=24)))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks][-1] == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)
    assert spec(chunks[-1].choices[0]) == spec(full.choices[0])


def test_stream_include_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            prompt=PROMPT,
            stream=True,
            stream_options={"include_usage": True},
            **greedy(max_tokens=8, ignore_eos=True),
        )  # fmt: skip
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8
    assert all(c.usage is None for c in body)
    assert spec(last)["drafted_tokens"] >= 0


def test_n_choices_and_seed(client: openai.OpenAI, tokenizer: Any) -> None:
    kw: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}
    kw |= {"n": 3, "extra_body": {"ignore_eos": True}}
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices], "same seed, same text"
    assert len({c.text for c in a.choices}) > 1, "choice i samples with seed + i"
    assert a.usage is not None and a.usage.completion_tokens == 3 * 16
    assert a.usage.prompt_tokens == len(tokenizer.encode(PROMPT)), "a prompt counts once"
    assert all(spec(choice)["drafted_tokens"] >= 0 for choice in a.choices)
    c = client.completions.create(seed=99, **kw)
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_n_streamed(client: openai.OpenAI) -> None:
    texts: dict[int, str] = {0: "", 1: ""}
    finished: set[int] = set()
    stream = client.completions.create(
        prompt=PROMPT, stream=True, n=2, seed=7, model="tiny", max_tokens=10, temperature=1.0
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    full = client.completions.create(
        prompt=PROMPT, n=2, seed=7, model="tiny", max_tokens=10, temperature=1.0
    )
    assert [texts[0], texts[1]] == [c.text for c in full.choices]


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(
        prompt=PROMPT, logprobs=3, **greedy(max_tokens=6, ignore_eos=True)
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs or []) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs or [], strict=True):
        assert value is not None and value <= 0
        assert top is not None and 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(value), "greedy: the token is the best one"
        assert token in top
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_echo_with_prompt_logprobs(client: openai.OpenAI, tokenizer: Any) -> None:
    r = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **greedy(max_tokens=4))
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    num_prompt = len(tokenizer.encode(PROMPT))
    assert len(lp.token_logprobs) == num_prompt + r.usage.completion_tokens  # type: ignore[union-attr]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    plain = client.completions.create(prompt=PROMPT, **greedy(max_tokens=4))
    assert choice.text == PROMPT + plain.choices[0].text


def test_echo_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(prompt=PROMPT, echo=True, stream=True, **greedy()))
    full = client.completions.create(prompt=PROMPT, echo=True, **greedy())
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_stop_string(client: openai.OpenAI) -> None:
    base = client.completions.create(prompt=PROMPT, **greedy(max_tokens=24, ignore_eos=True))
    text = base.choices[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    cut = client.completions.create(
        prompt=PROMPT, stop=[stop, "@@never@@"], **greedy(max_tokens=24)
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    single = client.completions.create(prompt=PROMPT, stop=stop, **greedy(max_tokens=24))
    assert single.choices[0].text == cut.choices[0].text


def test_return_token_ids_and_no_speculation(client: openai.OpenAI, tokenizer: Any) -> None:
    extra = {"return_token_ids": True, "num_speculative_tokens": 0}
    r = client.completions.create(prompt=PROMPT, **greedy(max_tokens=8, extra_body=extra))
    extra = r.choices[0].model_extra
    assert extra["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert tokenizer.decode(extra["token_ids"]) == r.choices[0].text
    assert spec(r)["drafted_tokens"] == 0
    speculative = client.completions.create(prompt=PROMPT, **greedy(max_tokens=8))
    assert speculative.choices[0].text == r.choices[0].text, "speculation never changes greedy text"


def test_unknown_openai_fields_are_ignored(client: openai.OpenAI) -> None:
    extra = {"logit_bias": {"5": 1}, "service_tier": "auto", "whatever": [1, 2]}
    r = client.completions.create(
        prompt=PROMPT, user="someone", **greedy(max_tokens=3, extra_body=extra)
    )
    assert r.choices[0].finish_reason in ("length", "stop")


# ---------------------------------------------------------------------------- chat


def test_chat_shape_and_content_parts(client: openai.OpenAI, tokenizer: Any) -> None:
    r = client.chat.completions.create(messages=MESSAGES, **greedy(max_tokens=10))
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    parts = [{"role": "user", "content": [
        {"type": "text", "text": "Hello, world! "}, {"type": "text", "text": "How are you today?"},
    ]}]  # fmt: skip
    r2 = client.chat.completions.create(messages=parts, **greedy(max_tokens=10))  # type: ignore[arg-type]
    assert r2.choices[0].message.content == msg.content
    assert spec(r)["drafted_tokens"] >= 0


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = greedy(max_completion_tokens=20)
    del kw["max_tokens"]
    full = client.chat.completions.create(messages=MESSAGES, **kw)
    chunks = list(
        client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    *body, usage_chunk = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content
    )
    assert body[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage
    assert full.usage is not None and full.usage.completion_tokens <= 20


def test_chat_logprobs_n_seed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.8)
    r = client.chat.completions.create(logprobs=True, top_logprobs=2, n=2, seed=5, **kw)
    again = client.chat.completions.create(logprobs=True, top_logprobs=2, n=2, seed=5, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    for choice in r.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) >= 1
        for item in choice.logprobs.content:
            assert item.logprob <= 0 and len(item.top_logprobs) == 2
            assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    plain = client.chat.completions.create(seed=5, **kw)
    assert plain.choices[0].logprobs is None


def test_chat_stop(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(
        messages=MESSAGES, **greedy(max_tokens=20, ignore_eos=True)
    )
    text = base.choices[0].message.content or ""
    stop = next(text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip())
    cut = client.chat.completions.create(messages=MESSAGES, stop=stop, **greedy(max_tokens=20))
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------- other routes


def test_models_and_tokenizer_routes(server: RealServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers) as http:
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == PROMPT
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["count"] > tokens["count"] / 2
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|endoftext|>" and "im_start" in info["chat_template"]
        assert http.get("/version").json()["version"]
        assert http.get("/health").json() == {"status": "ready"}
        card = http.get("/v1/models").json()["data"][0]
        dtype = card["weights"][0]["quantization"]  # a float checkpoint with quantization auto
        assert card["quantization"] == dtype and dtype in ("float32", "bf16")
        assert card["weights"][0]["weight_bytes"] > 0


def test_streamed_logprobs_match(client: openai.OpenAI) -> None:
    kw = greedy(max_tokens=10, ignore_eos=True, logprobs=2, echo=True)
    full = client.completions.create(prompt=PROMPT, **kw).choices[0].logprobs
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    for chunk in client.completions.create(prompt=PROMPT, stream=True, **kw):
        lp = chunk.choices[0].logprobs
        assert lp is not None
        tokens += lp.tokens or []
        values += lp.token_logprobs or []
        offsets += lp.text_offset or []
    assert full is not None
    assert tokens == full.tokens and offsets == full.text_offset
    assert values == pytest.approx(full.token_logprobs)


def test_chat_return_token_ids(client: openai.OpenAI, tokenizer: Any) -> None:
    kw = greedy(max_tokens=6, extra_body={"return_token_ids": True})
    r = client.chat.completions.create(messages=MESSAGES, **kw)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    extra = r.choices[0].model_extra or {}
    assert extra["prompt_token_ids"] == prompt_ids == (r.model_extra or {})["prompt_token_ids"]
    assert tokenizer.decode(extra["token_ids"]) == r.choices[0].message.content
    streamed: list[int] = []
    for chunk in client.chat.completions.create(messages=MESSAGES, stream=True, **kw):
        streamed += (chunk.choices[0].model_extra or {}).get("token_ids") or []
    assert streamed == extra["token_ids"]
