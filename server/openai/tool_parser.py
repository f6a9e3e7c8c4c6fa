"""Tool calls in Qwen2.5's (Hermes) format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

One incremental parser serves both paths: a stream feeds it each text delta (several tokens may
arrive in one speculative step), a full response feeds it the whole text at once; so the streamed
fragments always reassemble to the non-streamed message. `arguments` is the model's own JSON text
for the arguments object (not re-serialized), which is what lets fragments stream as they come.
Content loses leading and trailing whitespace. A `</tool_call>` inside an argument string would
end the call early (the parser does not track JSON strings).

The grammar for `tool_choice` "required" or a named function is written in the same format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.sample.structured import JSON_OPTIONS

START, END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclass
class CallDelta:
    """A fragment of tool call `index`: the first carries id and name, the rest arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class ToolCallParser:
    """Splits model text into content and tool-call fragments, holding back what may yet turn
    out to be a tag or the closing brace of the call."""

    text: str = ""
    pos: int = 0  # everything before it has been emitted
    in_call: bool = False
    num_calls: int = 0  # calls whose header was emitted
    args_start: int | None = None  # where the current call's arguments begin
    args_sent: int = 0  # characters of the current call's arguments emitted
    content_started: bool = False
    pending_space: str = ""  # whitespace after content: sent only if more content follows
    # Given the tools' names, a reply that is only a call as bare JSON (or fenced ```json) counts
    # too: small models often drop the tags. Such a reply is held back until it is complete.
    tool_names: frozenset[str] = frozenset()

    def feed(self, delta: str) -> ParsedDelta:
        self.text += delta
        out = ParsedDelta()
        while self._advance(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._maybe_bare_call():
            call = _bare_call(self.text[self.pos :], self.tool_names)
            if call is not None:
                self._send_header(out, call[0])
                self._send_args(out, call[1])
                self.pos = len(self.text)
                return out
        while self._advance(out, final=True):
            pass
        if self.in_call and self.args_start is not None:  # cut short: send what there is
            self._send_args(out, self.text[self.args_start :].strip())
        elif self.pos < len(self.text):
            self._send_content(out, self.text[self.pos :])
        self.pos = len(self.text)
        return out

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def _advance(self, out: ParsedDelta, final: bool) -> bool:
        """One move; False when nothing more can be emitted yet."""
        if not self.in_call:
            return self._advance_text(out, final)
        return self._advance_call(out, final)

    def _maybe_bare_call(self) -> bool:
        rest = self.text[self.pos :].lstrip()
        return bool(self.tool_names) and not self.content_started and rest[:1] in ("{", "`", "")

    def _advance_text(self, out: ParsedDelta, final: bool) -> bool:
        start = self.text.find(START, self.pos)
        if start < 0 and not final and self._maybe_bare_call():
            return False
        if start < 0:
            safe = len(self.text) if final else len(self.text) - _partial_suffix(self.text, START)
            self._send_content(out, self.text[self.pos : max(safe, self.pos)])
            self.pos = max(safe, self.pos)
            return False
        self._send_content(out, self.text[self.pos : start])
        self.pos, self.in_call = start + len(START), True
        self.args_start, self.args_sent = None, 0
        return True

    def _advance_call(self, out: ParsedDelta, final: bool) -> bool:
        end = self.text.find(END, self.pos)
        body_end = len(self.text) if end < 0 else end
        if self.args_start is None:
            match = _HEADER.match(self.text, self.pos, body_end)
            name = _json_string(match.group(1)) if match is not None else None
            if match is None or name is None:
                return end >= 0 and self._close_unparsed(out, end)
            self._send_header(out, name)
            self.args_start = match.end()
        if end < 0:
            held = _held_args(self.text[self.args_start :])
            self._send_args(out, held)
            return False
        self._send_args(out, _final_args(self.text[self.args_start : end]))
        self.pos, self.in_call = end + len(END), False
        return True

    def _close_unparsed(self, out: ParsedDelta, end: int) -> bool:
        """A complete call not in name-first form: parse it whole, or give it back as text."""
        body = self.text[self.pos : end]
        try:
            call = json.loads(body)
            name, arguments = call["name"], call.get("arguments", {})
            assert isinstance(name, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            self._send_content(out, START + body + END)
        else:
            self._send_header(out, name)
            self._send_args(out, json.dumps(arguments, ensure_ascii=False))
        self.pos, self.in_call = end + len(END), False
        return True

    def _send_content(self, out: ParsedDelta, text: str) -> None:
        """Content without leading or trailing whitespace (as the full parse strips it)."""
        text = self.pending_space + text
        if not self.content_started:
            text = text.lstrip()
        kept = text.rstrip()
        self.pending_space = text[len(kept) :]
        if kept:
            out.content += kept
            self.content_started = True

    def _send_header(self, out: ParsedDelta, name: str) -> None:
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        out.calls.append(CallDelta(self.num_calls, "", id=call_id, name=name))
        self.num_calls += 1

    def _send_args(self, out: ParsedDelta, arguments: str) -> None:
        if len(arguments) > self.args_sent:
            out.calls.append(CallDelta(self.num_calls - 1, arguments[self.args_sent :]))
            self.args_sent = len(arguments)


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


def _bare_call(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments) if text is one call to a known tool as bare or fenced JSON."""
    text = text.strip()
    fenced = _FENCE.fullmatch(text)
    try:
        call = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return str(call["name"]), json.dumps(arguments, ensure_ascii=False)


def _json_string(quoted: str) -> str | None:
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _held_args(partial: str) -> str:
    """What of an unfinished call's arguments is safe to send: not a possible start of the
    closing tag, nor trailing space, nor a last `}` that may close the call object."""
    partial = partial[: len(partial) - _partial_suffix(partial, END)].strip()
    return partial[:-1] if partial.endswith("}") else partial


def _final_args(raw: str) -> str:
    """The arguments text once the call is closed: without the call object's own `}`."""
    raw = raw.strip()
    return raw[:-1].rstrip() if raw.endswith("}") else raw


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    calls: list[dict[str, Any]]  # OpenAI tool_calls: id, type, function {name, arguments}


def parse_message(text: str, tool_names: frozenset[str] = frozenset()) -> ParsedMessage:
    """A whole response: content and tool calls, exactly as a stream would have sent them."""
    parser = ToolCallParser(tool_names=tool_names)
    deltas = [parser.feed(text), parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[dict[str, Any]] = []
    for delta in (c for d in deltas for c in d.calls):
        if delta.id is not None:
            function = {"name": delta.name, "arguments": ""}
            calls.append({"id": delta.id, "type": "function", "function": function})
        calls[delta.index]["function"]["arguments"] += delta.arguments
    return ParsedMessage(content or None, calls)


# ---------------------------------------------------------------------------- grammars


def tool_call_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """Lark: one (or, if parallel, several) `<tool_call>` blocks of the given functions."""
    variants = [_call_schema(tool) for tool in tools]
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema["x-guidance"] = JSON_OPTIONS
    call = f'"{START}\\n" %json {json.dumps(schema)} "\\n{END}"'
    repeat = ' ("\\n" call)*' if parallel else ""
    return f"start: call{repeat}\ncall: {call}\n"


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_tags_as_tokens(grammar: str, tokenizer: Any) -> str:
    """Where the tokenizer has `<tool_call>` / `</tool_call>` as special tokens (Qwen2.5), the model
    emits them as single tokens, which a grammar's text literal never matches: refer to the tokens."""
    special = set(getattr(tokenizer, "all_special_tokens", [])) | set(tokenizer.get_added_vocab())
    if START in special:
        grammar = grammar.replace(f'"{START}\\n"', f'{START} "\\n"')
    if END in special:
        grammar = grammar.replace(f'"\\n{END}"', f'"\\n" {END}')
    return grammar
