"""The bundled Qwen2.5-Coder pair through the openai SDK: JSON-schema extraction always validates,
and a two-turn tool round trip works, streamed and not, with deltas that reassemble."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from server_utils import LiveServer
from test_tools import reassemble

pytestmark = pytest.mark.slow

TARGET = "bundled:qwen2.5-coder-1.5b-instruct"
DRAFT = "bundled:qwen2.5-coder-0.5b-instruct"
MODEL = "qwen2.5-coder-1.5b-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = [
    ("Maria", 34, "Lisbon"), ("Kenji", 51, "Osaka"), ("Amara", 27, "Lagos"),
    ("Lars", 45, "Oslo"), ("Priya", 39, "Pune"), ("Diego", 22, "Lima"),
    ("Fatima", 61, "Rabat"), ("Tom", 30, "Leeds"), ("Olga", 58, "Kazan"), ("Wei", 19, "Xi'an"),
]  # fmt: skip
PROMPTS = [
    f"{name} is {age} years old and lives in {city}. Extract the person as JSON."
    for name, age, city in PEOPLE
] + [
    f"Report: the customer, aged {age}, gave the name {name} and an address in {city}. "
    "Return name, age and city as JSON."
    for name, age, city in PEOPLE
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature in a city, in Celsius",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    from engine.core.async_engine import AsyncLLM
    from server.app import create_app
    from server.settings import Settings

    settings = Settings(
        model=TARGET, draft_model=DRAFT, served_model_name=MODEL, speculative_method="draft",
        num_speculative_tokens=4, speculative_adaptive=False, dtype="bfloat16", num_threads=2,
        kv_cache_gib=0.5, max_num_seqs=20, max_num_batched_tokens=1024, max_model_len=2048,
    )  # fmt: skip
    engine = AsyncLLM.from_config(settings.engine_config(), settings.model_name)
    with LiveServer(create_app(engine, settings)) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=900)


def test_json_schema_extraction_always_validates(client: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def extract(prompt: str) -> Any:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=48,
            temperature=0, response_format=fmt,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        return json.loads(r.choices[0].message.content or "")

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        people = list(pool.map(extract, PROMPTS))
    for person in people:
        jsonschema.validate(person, PERSON)
    right = sum(p["name"] == n and p["age"] == a for p, (n, a, _) in zip(people, PEOPLE * 2, strict=True))  # fmt: skip
    assert right >= 15, people  # the model does read the text


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client: openai.OpenAI, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": "How warm is it in Paris right now?"}]
    kw: dict[str, Any] = dict(model=MODEL, tools=[WEATHER], temperature=0, max_tokens=64)
    first = client.chat.completions.create(messages=messages, **kw)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    if stream:
        content, calls, finish = reassemble(client.chat.completions.create(messages=messages, stream=True, **kw))  # fmt: skip
        assert finish == "tool_calls" and content == choice.message.content
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]  # fmt: skip
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 21})},
    ]
    # The final answer: the 1.5B model would call again while tools are offered, so none are.
    kw["tool_choice"] = "none"
    if stream:
        content, calls, finish = reassemble(client.chat.completions.create(messages=messages, stream=True, **kw))  # fmt: skip
    else:
        final = client.chat.completions.create(messages=messages, **kw)
        content, calls, finish = final.choices[0].message.content, final.choices[0].message.tool_calls, final.choices[0].finish_reason  # fmt: skip
    assert not calls and finish in ("stop", "length")
    assert content is not None and "21" in content
