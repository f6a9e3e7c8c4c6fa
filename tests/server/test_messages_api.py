"""/v1/messages (Anthropic Messages) on a live server (real engine, tiny model with Qwen2.5's
chat template, n-gram speculation) through the official `anthropic` SDK: text, stop sequences,
max_tokens, streaming, a tool round trip, JSON output, count_tokens, keys and errors; bodies,
events and errors checked against Anthropic's published document."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from api_specs import sse_events, validate
from server_utils import RealServer, metric_value, real_server
from test_responses_api import DIGIT_SCHEMA, tool_model_dir  # noqa: F401 - a fixture

KEY = "k"
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tool_model_dir: Path) -> Iterator[RealServer]:  # noqa: F811
    with real_server(tool_model_dir, api_key=KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: RealServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: RealServer) -> Iterator[httpx.Client]:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client


def greedy(**kw: Any) -> dict[str, Any]:
    """Sampling fields travel in extra_body, as current anthropic SDKs send them."""
    extra = {"temperature": 0} | kw.pop("extra_body", {})
    return {"model": "tiny", "max_tokens": 12, "messages": ASK, "extra_body": extra} | kw


def test_text_message(client: anthropic.Anthropic) -> None:
    m = client.messages.create(**greedy(system="Be brief."))
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == "tiny" and m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] == ["text"]
    assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0
    assert "spec_decode" in (m.model_extra or {})


def test_max_tokens_stop(client: anthropic.Anthropic) -> None:
    m = client.messages.create(**greedy(max_tokens=5, extra_body={"ignore_eos": True}))
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    free = client.messages.create(**greedy(max_tokens=24, extra_body={"ignore_eos": True}))
    text = free.content[0].text  # type: ignore[union-attr]
    words = [w for w in re.finditer(r"[A-Za-z]{2,}", text) if w.start() > 0]
    assert words, f"no word to stop at in {text!r}"
    stop = words[0].group()
    m = client.messages.create(
        **greedy(max_tokens=24, stop_sequences=[stop], extra_body={"ignore_eos": True})
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def test_stream_equals_whole(client: anthropic.Anthropic, http: httpx.Client) -> None:
    args = greedy(max_tokens=16, extra_body={"ignore_eos": True})
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens
    body = {k: v for k, v in args.items() if k != "extra_body"} | args["extra_body"]
    with http.stream("POST", "/v1/messages", json=body | {"stream": True}) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_tool_round_trip(client: anthropic.Anthropic) -> None:
    args = greedy(max_tokens=200, tools=[WEATHER], tool_choice={"type": "any"})
    m = client.messages.create(**args)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]}]
    reply = client.messages.create(
        **greedy(messages=[*history, {"role": "user", "content": [result]}], tools=[WEATHER])
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens > (
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    )


def test_json_output(client: anthropic.Anthropic) -> None:
    fmt = {"format": {"type": "json_schema", "schema": DIGIT_SCHEMA}}
    m = client.messages.create(**greedy(max_tokens=40, output_config=fmt))
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), DIGIT_SCHEMA)  # type: ignore[union-attr]


def test_metrics_label_the_endpoint(client: anthropic.Anthropic, http: httpx.Client) -> None:
    client.messages.create(**greedy(max_tokens=2))
    text = http.get("/metrics").text
    assert metric_value(text, "specserve:api_requests_total", endpoint="messages") >= 1


def test_count_tokens(client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="tiny", messages=ASK, tools=[WEATHER])  # type: ignore[list-item]
    m = client.messages.create(**greedy(tools=[WEATHER], max_tokens=2))
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_bearer_works_and_a_bad_key_is_401(server: RealServer) -> None:
    body = greedy(max_tokens=2)
    body = {k: v for k, v in body.items() if k != "extra_body"}
    ok = httpx.post(server.url + "/v1/messages", json=body, headers={"Authorization": "Bearer k"})
    assert ok.status_code == 200
    bad = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert bad.status_code == 401
    body = bad.json()
    assert body["type"] == "error" and body["request_id"].startswith("req_")
    assert body["error"] == {
        "type": "authentication_error",
        "message": "invalid or missing API key",
    }


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"messages": ASK}, 400, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, 400, "messages"),
        ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400, "web_search"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]}]}, 400, "t1"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "block type"),
        ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool", "name": "x"}}, 400, "tool_choice"),
        ({"max_tokens": 4, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
        ({"max_tokens": 4, "messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "("}}}}, 400, "regex"),
        ({"max_tokens": 4, "messages": ASK, "model": "claude-nope"}, 404, "claude-nope"),
    ],
)  # fmt: skip
def test_errors_in_anthropic_shape(
    http: httpx.Client, body: dict[str, Any], status: int, needle: str
) -> None:
    r = http.post("/v1/messages", json={"model": "tiny"} | body)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )
    assert needle in payload["error"]["message"]


def test_malformed_json_is_anthropic_400(http: httpx.Client) -> None:
    r = http.post("/v1/messages", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


CONFORMANCE_BODIES: list[dict[str, Any]] = [
    {"max_tokens": 8, "messages": ASK, "system": "Be brief."},
    {"max_tokens": 200, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "any"}},
    {
        "max_tokens": 24,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Count"}]}],
        "stop_sequences": ["3"],
        "top_k": 1,
    },
]


@pytest.mark.parametrize("body", CONFORMANCE_BODIES)
def test_conforms_to_anthropic_document(http: httpx.Client, body: dict[str, Any]) -> None:
    body = {"model": "tiny", "temperature": 0} | body
    validate("anthropic", "CreateMessageParams", body)
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    validate("anthropic", "Message", r.json())
    events = sse_events(http, "/v1/messages", body)
    for name, event in events:
        assert name == event["type"]
        if event["type"] != "ping":  # Anthropic sends pings; its document does not list them
            validate("anthropic", "MessageStreamEvent", event)
    count = http.post(
        "/v1/messages/count_tokens", json={"model": "tiny", "messages": body["messages"]}
    )
    validate("anthropic", "CountMessageTokensResponse", count.json())
    for bad in (
        http.post("/v1/messages", json={"model": "tiny", "messages": []}),
        http.post("/v1/messages", json={"model": "nope", "max_tokens": 1, "messages": ASK}),
        http.post("/v1/messages", content=b"{"),
    ):
        assert 400 <= bad.status_code < 500
        validate("anthropic", "ErrorResponse", bad.json())
