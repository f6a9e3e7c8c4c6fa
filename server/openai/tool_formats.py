"""The tool-call formats of the families specserve serves, as their chat templates teach them.

A format says how a reply marks its calls (a start marker, an end marker, a JSON list or one
object per block, a separator) and how a call names its function and writes its arguments. One
incremental parser (tool_parser.py) reads every format; `tool_call_grammar` writes the grammar
that holds a `tool_choice` "required" or named turn to the same format.

| name | families | a call |
| --- | --- | --- |
| hermes | Qwen2.5, Qwen3, SmolLM3 | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` |
| llama3_json | Llama 3.1-3.3 | `{"name": ..., "parameters": {...}}` opening the reply, or after `<|python_tag|>`; several joined by `;` |
| mistral | Mistral (v3 tokenizers) | `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` |
| granite | Granite 3.x | `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` |
| phi4_mini_json | Phi-4-mini | `<|tool_call|>[...]<|/tool_call|>` (a list or one object), or `functools[...]` |
| glm4 | GLM-4-0414 (Glm4ForCausalLM) | `name\\n{arguments}` opening the reply, one call a line pair |

The server's `tool_call_parser` setting names one; `auto` (the default) reads the chat template's
markers (`detect_format`) and falls back to hermes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from engine.sample.structured import JSON_OPTIONS
from server.settings import ToolParserName


@dataclass(frozen=True)
class ToolFormat:
    name: str
    starts: tuple[str, ...] = ()  # markers that open a block of calls
    end: str = ""  # the marker that closes a block ("": the block ends with its JSON)
    array: bool = False  # a block holds a JSON list of calls (one object alone is taken too)
    separator: str = ""  # between the calls of one block written without a list
    leading_json: bool = False  # a reply opening with `{` is a call (Llama 3.x)
    name_line: bool = False  # a call is `name\n{arguments}`, opening the reply (GLM-4-0414)
    # The grammar's text: before the calls, between two, after them (markers as in `starts`/`end`).
    open: str = ""
    joiner: str = ""
    close: str = ""
    args_key: str = "arguments"  # what the grammar names the arguments

    @property
    def markers(self) -> tuple[str, ...]:
        return (*self.starts, self.end) if self.end else self.starts


HERMES = ToolFormat(
    "hermes",
    starts=("<tool_call>",),
    end="</tool_call>",
    open="<tool_call>\n",
    joiner="\n</tool_call>\n<tool_call>\n",
    close="\n</tool_call>",
)
FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        HERMES,
        ToolFormat(
            "llama3_json",
            starts=("<|python_tag|>",),
            separator=";",
            leading_json=True,
            joiner="; ",
            args_key="parameters",
        ),
        ToolFormat(
            "mistral", ("[TOOL_CALLS]",), array=True, open="[TOOL_CALLS][", joiner=", ", close="]"
        ),  # fmt: skip
        ToolFormat(
            "granite", ("<|tool_call|>",), array=True, open="<|tool_call|>[", joiner=", ", close="]"
        ),  # fmt: skip
        ToolFormat(
            "phi4_mini_json",
            starts=("<|tool_call|>", "functools"),
            end="<|/tool_call|>",
            array=True,
            open="<|tool_call|>[",
            joiner=", ",
            close="]<|/tool_call|>",
        ),
        ToolFormat("glm4", name_line=True, joiner="\n"),
    )
}
assert set(FORMATS) | {"auto"} == set(get_args(ToolParserName))

# What each template shows of its format, in the order tried: the first hit decides.
_TEMPLATE_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("phi4_mini_json", ("<|/tool_call|>", "<|/tool|>")),
    ("granite", ("<|tool_call|>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name')),
    ("glm4", ("<|observation|>",)),
)


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches (by the markers it writes); hermes if none shows."""
    for name, markers in _TEMPLATE_MARKERS:
        if chat_template and any(m in chat_template for m in markers):
            return FORMATS[name]
    return HERMES


def tool_format(name: str, tokenizer: Any) -> ToolFormat:
    """The setting's format; `auto`: the one the tokenizer's chat template shows."""
    if name != "auto":
        return FORMATS[name]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one speaks for them
        template = template.get("default") or next(iter(template.values()), None)
    return detect_format(template if isinstance(template, str) else None)


def marker_token_ids(fmt: ToolFormat, tokenizer: Any) -> dict[str, int]:
    """The format's markers that are single added tokens here, marker -> token id: a grammar
    names them as tokens (its text literal never matches one), and decoding keeps their text
    where it skips special tokens (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`)."""
    added: dict[str, int] = dict(tokenizer.get_added_vocab())
    return {m: added[m] for m in fmt.markers if m in added}


# ---------------------------------------------------------------------------- grammars


def tool_call_grammar(
    fmt: ToolFormat,
    tools: list[dict[str, Any]],
    parallel: bool,
    tokens: Mapping[str, int] | None = None,  # markers that are special tokens -> ids
) -> str:
    """Lark: one (or, if parallel, several) calls of the given functions in the format."""
    calls = [_call_rule(fmt, tool) for tool in tools]
    repeat = f" ({_literal(fmt.joiner, tokens)} call)*" if parallel else ""
    start = f"{_literal(fmt.open, tokens)} call{repeat} {_literal(fmt.close, tokens)}"
    return f"start: {start}\ncall: {' | '.join(calls)}\n"


def _call_rule(fmt: ToolFormat, function: dict[str, Any]) -> str:
    parameters: dict[str, Any] = dict(function.get("parameters") or {"type": "object"})
    if fmt.name_line:
        parameters["x-guidance"] = JSON_OPTIONS
        return f"{json.dumps(function['name'] + chr(10))} %json {json.dumps(parameters)}"
    schema = {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, fmt.args_key: parameters},
        "required": ["name", fmt.args_key],
        "additionalProperties": False,
        "x-guidance": JSON_OPTIONS,
    }
    return f"%json {json.dumps(schema)}"


def _literal(text: str, tokens: Mapping[str, int] | None) -> str:
    """Text as Lark: quoted strings, and `<[id]>` for a marker the model writes as one token
    (a grammar's text literal never matches a special token)."""
    parts: list[str] = []
    while text:
        hits = [(text.find(m), m) for m in tokens or {} if m in text]
        if not hits:
            parts.append(json.dumps(text))
            break
        at, marker = min(hits)
        if at:
            parts.append(json.dumps(text[:at]))
        parts.append(f"<[{(tokens or {})[marker]}]>")
        text = text[at + len(marker) :]
    return " ".join(parts) if parts else '""'
