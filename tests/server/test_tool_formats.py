"""Tool-call formats per family: each parsed whole, streamed a character at a time and in random
chunks (always the same message), several calls, content before a call, malformed output; the
format detected from real-looking chat templates; the setting; the tool_choice grammar."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tiny import build_tiny_tokenizer

from engine.sample import structured
from engine.sample.detokenizer import IncrementalDetokenizer
from server.openai.tool_formats import (
    FORMATS,
    HERMES,
    ToolFormat,
    detect_format,
    marker_token_ids,
    tool_call_grammar,
    tool_format,
)
from server.openai.tool_parser import ToolCallParser, parse_message
from server.settings import Settings, SettingsError

NAMES = frozenset({"get_weather", "get_time"})
PARIS = '{"city": "Paris", "unit": "c"}'
WEATHER = ["get_weather", PARIS]
TIME = ["get_time", '{"zone": 2}']

# (format, model text, expected content, expected [name, arguments] per call)
CASES: list[tuple[str, str, str | None, list[list[str]]]] = [
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
        None,
        [WEATHER],
    ),  # fmt: skip
    ("llama3_json", f'{{"name": "get_weather", "parameters": {PARIS}}}', None, [WEATHER]),
    (
        "llama3_json",
        f'{{"name": "get_weather", "parameters": {PARIS}}}; {{"name": "get_time", "parameters": {{"zone": 2}}}}',
        None,
        [WEATHER, TIME],
    ),  # fmt: skip
    (
        "llama3_json",
        f'Let me look.<|python_tag|>{{"name": "get_weather", "arguments": {PARIS}}}',
        "Let me look.",
        [WEATHER],
    ),  # fmt: skip
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    (
        "mistral",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "get_time", "arguments": {{"zone": 2}}}}]',
        None,
        [WEATHER, TIME],
    ),  # fmt: skip
    (
        "mistral",
        f'Checking.[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}]',
        "Checking.",
        [WEATHER],
    ),  # fmt: skip
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    (
        "granite",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {PARIS}}}]',
        None,
        [WEATHER],
    ),  # fmt: skip
    (
        "granite",
        'Sure. <|tool_call|>[{"arguments": {"zone": 2}, "name": "get_time"}]',
        "Sure.",
        [TIME],
    ),  # fmt: skip
    (
        "phi4_mini_json",
        f'<|tool_call|>[{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "get_time", "arguments": {{"zone": 2}}}}]<|/tool_call|>',
        None,
        [WEATHER, TIME],
    ),  # fmt: skip
    (
        "phi4_mini_json",
        f'I will call it.<|tool_call|>{{"name": "get_weather", "arguments": {PARIS}}}<|/tool_call|> Done.',
        "I will call it. Done.",
        [WEATHER],
    ),  # fmt: skip
    (
        "phi4_mini_json",
        f'functools[{{"name": "get_weather", "arguments": {PARIS}}}]',
        None,
        [WEATHER],
    ),  # fmt: skip
    ("glm4", f"get_weather\n{PARIS}", None, [WEATHER]),
    ("glm4", f'get_weather\n{PARIS}\nget_time\n{{"zone": 2}}', None, [WEATHER, TIME]),
    ("glm4", "\nThe weather is fine.", "The weather is fine.", []),
    ("glm4", "get_weather is a tool I have.", "get_weather is a tool I have.", []),
    # Strings that look like markers or braces stay inside the arguments.
    (
        "granite",
        '<|tool_call|>[{"name": "get_time", "arguments": {"q": "}] <|tool_call|> ["}}]',
        None,
        [["get_time", '{"q": "}] <|tool_call|> ["}']],
    ),  # fmt: skip
    # Malformed or cut short: never an error; what there is, as content or a partial call.
    (
        "granite",
        '<|tool_call|>[{"name": "get_time", "arguments": {"zone": ',
        None,
        [["get_time", '{"zone":']],
    ),  # fmt: skip
    ("mistral", '[TOOL_CALLS][{"nam', '[TOOL_CALLS][{"nam', []),
    (
        "phi4_mini_json",
        '<|tool_call|>{"name": 3}<|/tool_call|>',
        '<|tool_call|>{"name": 3}<|/tool_call|>',
        [],
    ),  # fmt: skip
    (
        "hermes",
        "<tool_call>not json</tool_call> after",
        "<tool_call>not json</tool_call> after",
        [],
    ),  # fmt: skip
]


def calls_of(parsed: Any) -> list[list[str]]:
    return [[c["function"]["name"], c["function"]["arguments"]] for c in parsed.calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_each_format_parses_whole(
    name: str, text: str, content: str | None, calls: list[list[str]]
) -> None:
    parsed = parse_message(text, NAMES, FORMATS[name])
    assert (parsed.content, calls_of(parsed)) == (content, calls)


def stream(fmt: ToolFormat, pieces: list[str]) -> tuple[str | None, list[list[str]]]:
    """Content and calls as a client rebuilds them from the deltas of these pieces."""
    parser, deltas = ToolCallParser(fmt, NAMES), []
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas) or None
    calls: dict[int, list[str]] = {}
    for delta in (c for d in deltas for c in d.calls):
        if delta.id is not None:
            assert delta.index not in calls and delta.arguments == ""
            calls[delta.index] = [delta.name or "", ""]
        calls[delta.index][1] += delta.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streams_of_any_chunking_give_the_whole_message(
    name: str, text: str, content: str | None, calls: list[list[str]]
) -> None:
    fmt = FORMATS[name]
    assert stream(fmt, list(text)) == (content, calls)  # a character at a time
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert stream(fmt, pieces) == (content, calls), pieces


def test_arguments_stream_before_the_call_ends() -> None:
    parser = ToolCallParser(FORMATS["mistral"], NAMES)
    first = parser.feed('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(c.name, c.arguments) for c in first.calls] == [
        ("get_weather", ""),
        (None, '{"city": "Pa'),
    ]
    assert parser.feed('ris"}}, {"name": "get_time"').calls[0].arguments == 'ris"}'


# ---- which format: the setting, or the chat template's markers ------------------------------

TEMPLATES = {
    "hermes": "{%- if tools %}For each function call, return a json object within <tool_call></tool_call> XML tags{%- endif %}",  # fmt: skip
    "llama3_json": '{%- if builtin_tools is defined or tools is not none %}{{- \'<|python_tag|>\' }}{%- endif %}Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.',  # fmt: skip
    "mistral": "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- for tool_call in message.tool_calls %}{%- endfor %}",  # fmt: skip
    "granite": "{%- elif message['role'] == 'assistant_tool_call' %}{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] + '<|end_of_text|>' }}",  # fmt: skip
    "phi4_mini_json": "{% if message['role'] == 'system' and 'tools' in message %}{{'<|system|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>'}}{% endif %}",  # fmt: skip
    "glm4": "[gMASK]<sop>{%- for message in messages %}{%- if message.role == 'observation' %}<|observation|>\n{{ message.content }}{%- endif %}{%- endfor %}",  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_format_is_detected_from_the_template(name: str) -> None:
    assert detect_format(TEMPLATES[name]).name == name


def test_without_markers_hermes_is_the_fallback() -> None:
    assert detect_format("{{ messages[0]['content'] }}") is HERMES
    assert detect_format(None) is HERMES


def test_the_setting_overrides_detection(tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer(tmp_path)
    tokenizer.chat_template = TEMPLATES["mistral"]
    assert tool_format("auto", tokenizer).name == "mistral"
    assert tool_format("granite", tokenizer).name == "granite"
    assert Settings(model="m", tool_call_parser="glm4").tool_call_parser == "glm4"
    with pytest.raises(SettingsError, match="tool_call_parser.*'hermes'"):
        Settings.load(model="m", tool_call_parser="qwen_xml")


# ---- the tool_choice grammar, in each format ---------------------------------------------------

TOOL = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer"}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammars_compile_and_accept_their_own_format(name: str, tmp_path: Path) -> None:
    fmt = FORMATS[name]
    tokenizer = build_tiny_tokenizer(tmp_path)
    for parallel in (False, True):
        grammar = structured.grammar_from("lark", tool_call_grammar(fmt, [TOOL], parallel))
        structured.check_grammar(grammar, tokenizer)
    call = (
        'get_time\n{"zone": 2}'
        if fmt.name_line
        else json.dumps({"name": "get_time", fmt.args_key: {"zone": 2}})
    )
    text = fmt.open + call + fmt.close
    assert calls_of(parse_message(text, NAMES, fmt)) == [TIME]


def test_special_markers_are_tokens_in_the_grammar_and_kept_in_the_text(tmp_path: Path) -> None:
    tokenizer = build_tiny_tokenizer(tmp_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    fmt = FORMATS["mistral"]
    tokens = marker_token_ids(fmt, tokenizer)
    (marker_id,) = tokens.values()
    lark = tool_call_grammar(fmt, [TOOL], False, tokens)
    assert f"<[{marker_id}]>" in lark and "[TOOL_CALLS]" not in lark
    structured.check_grammar(structured.grammar_from("lark", lark), tokenizer)
    ids = tokenizer.encode('[TOOL_CALLS][{"name": "get_time"', add_special_tokens=False)
    assert marker_id in ids

    def decoded(kept: tuple[int, ...]) -> str:
        detok = IncrementalDetokenizer(tokenizer, [], (), True, kept_special_ids=kept)
        for token in ids:
            detok.append(token)
        return detok.pop_delta(finished=True)

    assert decoded(()) == '[{"name": "get_time"'  # special tokens skipped
    assert decoded((marker_id,)) == '[TOOL_CALLS][{"name": "get_time"'


# ---- end to end: a Granite-format model through the server -------------------------------------

# Granite 3.x's template reduced to what the test needs; its `<|tool_call|>` is what `auto` finds.
GRANITE_TEMPLATE = """{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}<|end_of_text|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|start_of_role|>assistant<|end_of_role|><|tool_call|>{{ message.tool_calls | map(attribute='function') | list | tojson }}<|end_of_text|>
{%- else %}<|start_of_role|>{{ message.role }}<|end_of_role|>{{ message.content }}<|end_of_text|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{%- endif %}"""


@pytest.fixture(scope="module")
def granite_client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import openai
    from server_utils import real_server
    from tiny import make_tiny_model
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("granite_tools"), family="qwen2", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = GRANITE_TEMPLATE
    tokenizer.save_pretrained(str(path))
    with real_server(path, num_speculative_tokens=2) as live:
        assert live.settings.tool_call_parser == "auto"
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0), tokenizer


def test_a_granite_model_calls_tools_in_its_format_end_to_end(granite_client: Any) -> None:
    granite_client, tokenizer = granite_client
    tools = [{"type": "function", "function": TOOL}]
    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What time is it?"}],
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 60,
        "temperature": 0,
    }
    r = granite_client.chat.completions.create(extra_body={"return_token_ids": True}, **kw)
    (choice,) = r.choices
    raw = tokenizer.decode(choice.token_ids)  # what the model wrote: Granite's format
    assert raw.startswith('<|tool_call|>[{"name": "get_time", "arguments": '), raw
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert isinstance(json.loads(call.function.arguments)["zone"], int)
    streamed = granite_client.chat.completions.create(stream=True, **kw)
    content, parts = "", {}
    for chunk in streamed:
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta and delta.content) or ""
        for part in (delta and delta.tool_calls) or []:
            entry = parts.setdefault(part.index, [part.function.name, ""])
            entry[1] += part.function.arguments or ""
    assert not content and list(parts.values()) == [["get_time", call.function.arguments]]
