"""Tool calling in Qwen2.5's format: the template renders tools, `<tool_call>` output becomes
`message.tool_calls`, streams reassemble to the full response, required/named are enforced by a
grammar, and tool turns are accepted in the history."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from server_utils import real_server
from tiny import make_tiny_model
from transformers import AutoTokenizer

from server.openai.tool_parser import ToolCallParser, parse_message

# Qwen2.5's chat template, as its tokenizer_config.json ships it (default system prompt shortened).
QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(
        tmp_path_factory.mktemp("tool_model"), family="qwen2", seed=0, max_position_embeddings=4096
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def client(tool_model_dir: Path) -> Iterator[openai.OpenAI]:
    with real_server(tool_model_dir, num_speculative_tokens=4) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    args = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
    return client.chat.completions.create(**(args | kw))


def reassemble(chunks: Any) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """Content, tool calls and finish reason from a stream, as an SDK user would rebuild them."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function"
                assert call.function.arguments == ""
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                assert call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def assert_valid_calls(calls: list[Any], names: set[str], allow_none: bool = False) -> None:
    assert calls or allow_none
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---- tool_choice enforced by a grammar in the model's own format ------------------------------


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_a_tool_and_streams_the_same(client: openai.OpenAI, parallel: bool) -> None:
    kw = {"tool_choice": "required", "parallel_tool_calls": parallel}
    r = chat(client, **kw)
    (choice,) = r.choices
    assert choice.message.content is None
    calls = choice.message.tool_calls
    if parallel:  # a random model may chain calls until max_tokens cuts the last one
        assert choice.finish_reason in ("tool_calls", "length")
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert_valid_calls(complete or calls[:0], {"get_weather", "get_time"}, allow_none=True)
    else:
        assert choice.finish_reason == "tool_calls" and len(calls) == 1
        assert_valid_calls(calls, {"get_weather", "get_time"})
    content, streamed, finish = reassemble(chat(client, stream=True, **kw))
    assert finish == choice.finish_reason and content is None
    expected = [(c.function.name, c.function.arguments) for c in calls]
    assert [(c["name"], c["arguments"]) for c in streamed] == expected


def test_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    for name in ("get_weather", "get_time"):
        choice = {"type": "function", "function": {"name": name}}
        r = chat(client, tool_choice=choice, parallel_tool_calls=False, temperature=1.0, seed=3)
        assert r.choices[0].finish_reason == "tool_calls"
        assert_valid_calls(r.choices[0].message.tool_calls, {name})


def test_none_and_auto_leave_free_text(client: openai.OpenAI) -> None:
    for tool_choice in ("none", "auto"):
        r = chat(client, tool_choice=tool_choice, max_tokens=12)
        (choice,) = r.choices
        assert choice.message.tool_calls in (None, []) and choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_tools_are_rendered_only_when_usable(client: openai.OpenAI) -> None:
    def prompt_tokens(**kw: Any) -> int:
        return int(chat(client, max_tokens=1, **kw).usage.prompt_tokens)

    plain = prompt_tokens(tools=openai.NOT_GIVEN)
    assert prompt_tokens(tool_choice="none") == plain
    assert prompt_tokens(tool_choice="auto") > plain + 20


# ---- a two-turn round trip: call, tool result, final answer ----------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_round_trip_with_tool_results_in_the_history(
    client: openai.OpenAI, stream: bool, tool_model_dir: Path
) -> None:
    first = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    if stream:
        content, calls, finish = reassemble(
            chat(client, messages=history, max_tokens=8, stream=True)
        )
        assert content and not calls and finish == "length"
    else:
        r = chat(client, messages=history, max_tokens=8)
        assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    rendered = AutoTokenizer.from_pretrained(str(tool_model_dir)).apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]}, history[2]],  # fmt: skip
        tools=TOOLS, tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    usage = chat(client, messages=history, max_tokens=1).usage
    tokenizer = AutoTokenizer.from_pretrained(str(tool_model_dir))
    assert usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert f'"arguments": {call.function.arguments}' in rendered  # arguments as an object


# ---- the parser: streams of any chunking reassemble to the full response ----------------------

TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": [1, {"y": "}<tool"}]}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"q": 1}, "name": "s"}\n</tool_call>',
    "a < b and <tool_c but no call",
    '<tool_call>\n{"name": "f", "arguments": {"q": "unterminated',
    "<tool_call>not json</tool_call> after",
    '<tool_call>{"name": "bad\\escape", "arguments": {}}</tool_call>',
]


def test_parse_message() -> None:
    full = parse_message(TEXTS[0])
    assert full.content == "Let me check."
    (call,) = full.calls
    assert call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris", "unit": "c"}',
    }
    two = parse_message(TEXTS[1])
    assert [c["function"]["arguments"] for c in two.calls] == [
        "{}",
        '{"x": [1, {"y": "}<tool"}]}',
    ]
    assert parse_message(TEXTS[2]).calls[0]["function"] == {"name": "s", "arguments": '{"q": 1}'}
    assert parse_message(TEXTS[3]) == parse_message(TEXTS[3]) and not parse_message(TEXTS[3]).calls
    assert parse_message(TEXTS[5]).content == TEXTS[5]


BARE = [
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
    '  {"name": "get_time", "arguments": {"zone": 2}}',
    '{"name": "unknown_tool", "arguments": {}}',
    '{"not": "a call"}',
    "``` not json ```",
]


def test_bare_json_calls_of_known_tools() -> None:
    names = frozenset({"get_weather", "get_time"})
    weather = parse_message(BARE[0], names)
    assert weather.content is None
    assert weather.calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert parse_message(BARE[1], names).calls[0]["function"]["name"] == "get_time"
    for text in BARE[2:]:
        parsed = parse_message(text, names)
        assert not parsed.calls and parsed.content == text.strip()
    assert not parse_message(BARE[0]).calls  # without tools: just text


@pytest.mark.parametrize("text", TEXTS + BARE)
def test_any_chunking_streams_what_the_full_parse_gives(text: str) -> None:
    names = frozenset({"get_weather", "get_time", "a", "b", "s", "f"})
    full = parse_message(text, names)
    rng = random.Random(0)
    for _ in range(100):
        parser, deltas, i = ToolCallParser(tool_names=names), [], 0
        while i < len(text):
            size = rng.randint(1, 8)
            deltas.append(parser.feed(text[i : i + size]))
            i += size
        deltas.append(parser.finish())
        content = "".join(d.content for d in deltas).strip() or None
        calls: dict[int, list[str]] = {}
        for delta in (c for d in deltas for c in d.calls):
            if delta.id is not None:
                calls[delta.index] = [delta.name or "", ""]
            calls[delta.index][1] += delta.arguments
        assert content == full.content
        assert [calls[i] for i in sorted(calls)] == [
            [c["function"]["name"], c["function"]["arguments"]] for c in full.calls
        ]
