"""/v1/responses on a live server (real engine, tiny model with Qwen2.5's chat template, n-gram
speculation, an API key) through the official `openai` SDK and the OpenAI Agents SDK: text, JSON
schema, function tools, streaming, the response store and previous_response_id, background and
cancel, speculative = plain, errors; bodies and events checked against OpenAI's document."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from api_specs import sse_events, validate
from pydantic import BaseModel, Field
from server_utils import RealServer, assert_error_shape, metric_value, real_server, wait_for
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
BAD: dict[str, Any] = {"type": "string", "pattern": "("}  # llguidance refuses the regex
KEY = "test-key"


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
    with real_server(tool_model_dir, response_store_path=str(store), api_key=KEY) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: RealServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: RealServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
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
    running = ("queued", "in_progress")
    wait_for(lambda: client.responses.retrieve(done.id).status not in running, what="background")
    assert client.responses.retrieve(done.id).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError, match="not in progress"):
        client.responses.cancel(done.id)


def test_cancel_a_stream(server: RealServer, http: httpx.Client) -> None:
    body = greedy(input="Count", max_output_tokens=300, ignore_eos=True, stream=True)
    server.throttle.delay_s = 0.05
    try:
        with http.stream("POST", "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = json.loads(first[6:])["response"]["id"]
            assert http.post(f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    finally:
        server.throttle.delay_s = 0.0
    assert rest[-1]["type"] == "response.failed"
    assert rest[-1]["response"]["status"] == "cancelled"
    assert http.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"


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
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD}}},
            "regex",
        ),
        (
            {"input": "x", "tools": [WEATHER | {"parameters": BAD}], "tool_choice": "required"},
            "regex",
        ),
        ({"input": "x", "previous_response_id": "resp_nope"}, "not found"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ],
)
def test_bad_requests_are_400(http: httpx.Client, body: dict[str, Any], needle: str) -> None:
    r = http.post("/v1/responses", json={"model": "tiny"} | body)
    assert r.status_code == 400, r.text
    assert needle in assert_error_shape(r.json(), 400)["message"]


def test_metrics_label_the_endpoint(client: openai.OpenAI, http: httpx.Client) -> None:
    def count() -> float:
        text = http.get("/metrics").text
        return metric_value(text, "specserve:api_requests_total", endpoint="responses")

    before = count()
    client.responses.create(input="Hi", **greedy(max_output_tokens=2))
    assert count() == before + 1


def test_speculative_equals_plain(client: openai.OpenAI) -> None:
    args = greedy(input="The quick brown fox. The quick brown", max_output_tokens=24)
    speculative = client.responses.create(**args, extra_body={"ignore_eos": True})
    plain = client.responses.create(
        **args, extra_body={"ignore_eos": True, "num_speculative_tokens": 0}
    )
    summary = (speculative.model_extra or {})["spec_decode"]
    assert summary["drafted_tokens"] > 0, "the repeated prompt gives the n-gram proposer drafts"
    assert (plain.model_extra or {})["spec_decode"]["drafted_tokens"] == 0
    assert speculative.output_text == plain.output_text


# ---------------------------------------------------------------------------- the Agents SDK


class Answer(BaseModel):
    weather: Literal["sunny", "rainy"]


def test_agents_runner_tool_round_trip(server: RealServer) -> None:
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model="tiny", openai_client=client),
        # The first turn must call the tool; the SDK then resets tool_choice, so the second
        # turn answers, in JSON held to the output type's schema (so the random model ends).
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=200),
        output_type=Answer,
    )
    result = asyncio.run(agents.Runner.run(agent, ASK, max_turns=3))
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == 2


# ---------------------------------------------------------------------------- conformance

# Stream event type -> its schema in OpenAI's document.
EVENT_SCHEMAS = {
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
CONFORMANCE_BODIES: list[dict[str, Any]] = [
    {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 16, "metadata": {"k": "v"}},
    {"input": ASK, "tools": [WEATHER], "tool_choice": "required"},
    {"input": "A digit", "text": {"format": {"type": "json_schema", "name": "d", "schema": DIGIT_SCHEMA}}},
]  # fmt: skip


@pytest.mark.parametrize("body", CONFORMANCE_BODIES)
def test_conforms_to_openai_document(http: httpx.Client, body: dict[str, Any]) -> None:
    body = {"model": "tiny", "temperature": 0, "max_output_tokens": 200} | body
    validate("openai", "CreateResponse", body)
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    validate("openai", "Response", r.json())
    events = sse_events(http, "/v1/responses", body)
    for name, event in events:
        assert name == event["type"]
        validate("openai", EVENT_SCHEMAS[event["type"]], event)
    streamed = events[-1][1]["response"]["output"]
    ids = ("id", "call_id")  # the stream's own; all else as the whole response
    whole = [
        a | {k: b[k] for k in ids if k in a}
        for a, b in zip(r.json()["output"], streamed, strict=True)
    ]
    assert whole == streamed
    items = http.get(f"/v1/responses/{r.json()['id']}/input_items")
    validate("openai", "ResponseItemList", items.json())
    for bad in (
        http.get("/v1/responses/resp_missing"),
        http.post("/v1/responses", json={"input": "x", "tools": [{"type": "web_search"}]}),
    ):
        validate("openai", "ErrorResponse", bad.json())
