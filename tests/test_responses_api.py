"""/v1/responses on a live server (real engine, tiny model with Qwen2.5's chat template, n-gram
speculation) through the official `openai` SDK: text, JSON schema, function tools, streaming,
the response store and previous_response_id, background and cancel, errors."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import RealServer, assert_error_shape, real_server, wait_for
from test_tools import QWEN_TEMPLATE
from tiny import make_tiny_model
from transformers import AutoTokenizer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the weather in Paris?"


class Digit(BaseModel):
    a: int = Field(ge=0, le=9)


DIGIT_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(
        tmp_path_factory.mktemp("responses_model"), seed=0, max_position_embeddings=4096
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def server(tool_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    store = tmp_path_factory.mktemp("store") / "responses.sqlite3"
    with real_server(tool_model_dir, response_store_path=str(store)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def http(server: RealServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def greedy(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0, "max_output_tokens": 12} | kw


def test_text_response(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Hello there", **greedy())
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete")
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text
    assert r.usage is not None and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert "spec_decode" in (r.model_extra or {})


def test_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(
        input="Count: 1 2 3 4 5", **greedy(max_output_tokens=5), extra_body={"ignore_eos": True}
    )
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 5
    assert r.output[0].status == "incomplete"


def test_stream_equals_whole(client: openai.OpenAI) -> None:
    args = greedy(input="Hello, world!", instructions="Be brief.", max_output_tokens=16)
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]  # get_final_response: completed only
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{whole.status}",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == whole.status
    assert final.usage is not None and whole.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_parses(client: openai.OpenAI) -> None:
    r = client.responses.parse(
        input="A digit please", text_format=Digit, **greedy(max_output_tokens=40)
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Digit) and 0 <= r.output_parsed.a <= 9
    fmt = {"format": {"type": "json_schema", "name": "digit", "schema": DIGIT_SCHEMA}}
    with client.responses.stream(
        input="A digit please", text=fmt, **greedy(max_output_tokens=40)
    ) as s:
        streamed = s.get_final_response()
    assert Digit.model_validate_json(streamed.output_text) == r.output_parsed


def test_function_call_round_trip(client: openai.OpenAI, http: httpx.Client) -> None:
    first = client.responses.create(
        input=ASK, tools=[WEATHER], tool_choice="required", **greedy(max_output_tokens=200)
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    chained = client.responses.create(
        input=[result], previous_response_id=first.id, tools=[WEATHER], **greedy()
    )
    assert chained.previous_response_id == first.id
    items = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True), result]
    full = client.responses.create(input=items, tools=[WEATHER], **greedy())
    # The same conversation either way: the same prompt, so the same greedy output.
    assert full.usage is not None and chained.usage is not None
    assert full.usage.input_tokens == chained.usage.input_tokens
    assert _texts(full) == _texts(chained)
    with client.responses.stream(
        input=[result], previous_response_id=first.id, tools=[WEATHER], **greedy()
    ) as stream:
        assert _texts(list(stream)[-1].response) == _texts(chained)  # type: ignore[union-attr]


def _texts(r: Any) -> list[tuple[str, str]]:
    return [
        (item.type, item.content[0].text if item.type == "message" else item.arguments)
        for item in r.output
    ]


def test_streamed_function_call(client: openai.OpenAI) -> None:
    args = greedy(input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=200)
    whole = client.responses.create(**args)
    with client.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == whole.output[-1].arguments  # type: ignore[union-attr]
    assert _texts(final) == _texts(whole)


def test_store_get_delete_and_input_items(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.responses.create(input="Hello", metadata={"k": "v"}, **greedy())
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    items = client.responses.input_items.list(r.id)
    (item,) = items.data
    assert item.type == "message" and item.role == "user"  # type: ignore[union-attr]
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    missing = http.get("/v1/responses/resp_nope")
    assert missing.status_code == 404
    assert assert_error_shape(missing.json(), 404)["code"] == "response_not_found"
    assert http.delete("/v1/responses/resp_nope").status_code == 404


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    r = client.responses.create(input="Hello", store=False, **greedy())
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(input="Again", previous_response_id=r.id, **greedy())


def test_background_and_cancel(client: openai.OpenAI, server: RealServer) -> None:
    server.throttle.delay_s = 0.05
    try:
        r = client.responses.create(
            input="Count", background=True, **greedy(max_output_tokens=300),
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.status == "queued" and r.background
        time.sleep(0.3)
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled"
    finally:
        server.throttle.delay_s = 0.0
    assert client.responses.retrieve(r.id).status == "cancelled"
    done = client.responses.create(input="Hi", background=True, **greedy(max_output_tokens=4))
    wait_for(lambda: client.responses.retrieve(done.id).status != "queued", what="background")
    assert client.responses.retrieve(done.id).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="not in progress"):
        client.responses.cancel(done.id)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "c1"),
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, "item type"),
        ({"input": []}, "input"),
        ({"input": "x", "tool_choice": "required"}, "tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "not found"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ],
)
def test_bad_requests_are_400(http: httpx.Client, body: dict[str, Any], needle: str) -> None:
    r = http.post("/v1/responses", json={"model": "tiny"} | body)
    assert r.status_code == 400, r.text
    assert needle in assert_error_shape(r.json(), 400)["message"]
