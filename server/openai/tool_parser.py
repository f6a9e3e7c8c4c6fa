"""Tool calls in model text, in any format of tool_formats.py (Hermes' `<tool_call>` blocks,
Llama 3.x's bare JSON, Mistral's and Granite's lists, Phi-4-mini's, GLM-4-0414's name lines).

One incremental parser serves both paths: a stream feeds it each text delta (several tokens may
arrive in one speculative step), a full response feeds it the whole text at once; so the streamed
fragments always reassemble to the non-streamed message. It decides only once the text decides
(it holds back what may yet turn out to be a marker, a call's name or the end of its arguments).
`arguments` is the model's own JSON text for the arguments (not re-serialized), which is what
lets fragments stream as they come; a small scanner that tracks JSON strings and nesting finds
where they end. Content loses leading and trailing whitespace. A block that turns out not to be
a call (not JSON, no name) is given back as content; a call cut short sends what there is.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from server.openai.tool_formats import HERMES, ToolFormat

_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')
_SPACE = re.compile(r"\s*")


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
class JsonScan:
    """Where a JSON value that starts at `pos` ends, found a character at a time; an `end_marker`
    outside a string cuts it there (a call's arguments left unclosed before the block's end)."""

    pos: int
    end_marker: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    end: int | None = None  # one past the value's last character, once known

    def run(self, text: str) -> None:
        while self.end is None and self.pos < len(text):
            if not self.in_string and self.end_marker:
                if text.startswith(self.end_marker, self.pos):
                    self.end = self.pos
                    return
                if self.end_marker.startswith(text[self.pos :]):
                    return  # may be the marker's start: wait for more text
            self._step(text[self.pos])
            if self.end is None:
                self.pos += 1

    def _step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:
                    self.end = self.pos + 1
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]" and self.depth > 0:
            self.depth -= 1
            if self.depth == 0:
                self.end = self.pos + 1
        elif self.depth == 0 and (ch in ",;}]" or ch.isspace()):
            self.end = self.pos  # a bare number or literal ends before its delimiter


State = Literal["text", "block", "args", "tail"]


@dataclass
class ToolCallParser:
    """Splits model text into content and tool-call fragments. States: `text` (content, looking
    for a start marker), `block` (inside a block, between calls), `args` (streaming a call's
    arguments), `tail` (the rest of a call object after its arguments)."""

    fmt: ToolFormat = HERMES
    # Given the tools' names, a reply that is only a call as bare JSON (or fenced ```json) counts
    # too: small models often drop the tags. Such a reply is held back until it is complete.
    # GLM-4-0414's calls are told from text by these names.
    tool_names: frozenset[str] = frozenset()
    text: str = ""
    pos: int = 0  # everything before it has been emitted (or consumed)
    state: State = "text"
    opened: bool = False  # the reply's opening was looked at (leading_json, name_line formats)
    block_start: int = 0  # where the current block's marker begins
    in_list: bool = False  # inside the block's `[...]`
    expect_call: bool = False  # the block may go on with a call here
    block_calls: int = 0  # calls in the current block
    num_calls: int = 0  # calls whose header was emitted
    in_object: bool = False  # the current call's arguments sit in a `{"name": ...}` object
    args_start: int = 0  # where the current call's arguments begin
    args_sent: int = 0  # characters of the current call's arguments emitted
    scan: JsonScan = field(default_factory=lambda: JsonScan(0))
    content_started: bool = False
    pending_space: str = ""  # whitespace after content: sent only if more content follows

    def feed(self, delta: str) -> ParsedDelta:
        self.text += delta
        out = ParsedDelta()
        while self._advance(out, final=False):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.state == "text" and self._maybe_bare_call():
            call = _bare_call(self.text[self.pos :], self.tool_names)
            if call is not None:
                self._send_header(out, call[0])
                self._send_args(out, call[1])
                self.pos = len(self.text)
                return out
        while self._advance(out, final=True):
            pass
        if self.state == "args":  # cut short: send what there is
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
        if self.state == "text":
            return self._advance_text(out, final)
        if self.state == "block":
            return self._advance_block(out, final)
        if self.state == "args":
            return self._advance_args(out, final)
        return self._advance_tail(final)

    # ------------------------------------------------------------------ content

    def _maybe_bare_call(self) -> bool:
        if self.fmt.leading_json or self.fmt.name_line or self.num_calls:
            return False
        rest = self.text[self.pos :].lstrip()
        return bool(self.tool_names) and not self.content_started and rest[:1] in ("{", "`", "")

    def _advance_text(self, out: ParsedDelta, final: bool) -> bool:
        if not self.opened and (self.fmt.leading_json or self.fmt.name_line):
            return self._open(final)
        start, marker = self._find_marker()
        if start < 0 and not final and self._maybe_bare_call():
            return False
        if start < 0:
            safe = len(self.text) if final else len(self.text) - self._partial_marker()
            self._send_content(out, self.text[self.pos : max(safe, self.pos)])
            self.pos = max(safe, self.pos)
            return False
        self._send_content(out, self.text[self.pos : start])
        self._enter_block(start, start + len(marker))
        return True

    def _open(self, final: bool) -> bool:
        """The reply's start: Llama's `{` or GLM's name line open a block without a marker."""
        i = _skip_space(self.text, self.pos)
        if i == len(self.text) and not final:
            return False
        self.opened = True
        if i < len(self.text) and (self.fmt.name_line or self.text[i] == "{"):
            self._enter_block(i, i)
        return True

    def _find_marker(self) -> tuple[int, str]:
        hits = [(self.text.find(m, self.pos), m) for m in self.fmt.starts]
        found = [(at, m) for at, m in hits if at >= 0]
        return min(found) if found else (-1, "")

    def _partial_marker(self) -> int:
        return max((_partial_suffix(self.text, m) for m in self.fmt.starts), default=0)

    # ------------------------------------------------------------------ blocks

    def _enter_block(self, start: int, after_marker: int) -> None:
        self.state, self.block_start, self.pos = "block", start, after_marker
        self.in_list, self.expect_call, self.block_calls = False, True, 0

    def _advance_block(self, out: ParsedDelta, final: bool) -> bool:
        i = _skip_space(self.text, self.pos)
        rest, end = self.text[i:], self.fmt.end
        if not rest:
            return final and self._leave_block(out)
        if end and rest.startswith(end):
            self.pos, self.state = i + len(end), "text"
            return True
        if end and end.startswith(rest) and not final:
            return False
        if self._punctuation(rest[0], i):
            return True
        if self.fmt.separator and self.block_calls and rest.startswith(self.fmt.separator):
            self.pos, self.expect_call = i + len(self.fmt.separator), True
            return True
        if self.expect_call:
            return self._start_call(out, i, final)
        return self._leave_block(out)

    def _punctuation(self, ch: str, i: int) -> bool:
        """A list's `[`, `,` and `]`; True if `ch` was one (and taken)."""
        if self.in_list and ch == "]":
            self.pos, self.in_list, self.expect_call = i + 1, False, False
            self.state = "block" if self.fmt.end else "text"
        elif self.in_list and ch == "," and self.block_calls:
            self.pos, self.expect_call = i + 1, True
        elif self.fmt.array and ch == "[" and not self.in_list and not self.block_calls:
            self.pos, self.in_list, self.expect_call = i + 1, True, True
        else:
            return False
        return True

    def _leave_block(self, out: ParsedDelta) -> bool:
        """Not (or no longer) calls: a block that made none is given back as content."""
        if not self.block_calls:
            self._send_content(out, self.text[self.block_start : self.pos])
        self.state, self.in_list = "text", False
        return True

    # ------------------------------------------------------------------ calls

    def _start_call(self, out: ParsedDelta, i: int, final: bool) -> bool:
        if self.fmt.name_line:
            return self._start_named(out, i, final)
        if self.text[i] != "{":
            return self._leave_block(out)
        match = _HEADER.match(self.text, i)
        name = _json_string(match.group(1)) if match is not None else None
        if match is not None and name is not None:
            j = _skip_space(self.text, match.end())
            if j < len(self.text):
                self._start_args(out, name, j, in_object=True)
                return True
            if not final:
                return False
        return self._whole_object(out, i, final)

    def _whole_object(self, out: ParsedDelta, i: int, final: bool) -> bool:
        """A call not in name-first form: parsed once its object is complete."""
        scan = JsonScan(i, self.fmt.end)
        scan.run(self.text)
        if scan.end is None and not final:
            return False
        call = _call_of(self.text[i : scan.end])
        if call is None:
            return self._leave_block(out)
        self._send_header(out, call[0])
        self._send_args(out, call[1])
        self.pos = scan.end if scan.end is not None else len(self.text)
        self._call_done()
        return True

    def _start_named(self, out: ParsedDelta, i: int, final: bool) -> bool:
        """GLM-4-0414: a line naming a tool, then the arguments' JSON object."""
        newline = self.text.find("\n", i)
        line = self.text[i : newline if newline >= 0 else len(self.text)].strip()
        if newline < 0:
            maybe = any(name.startswith(line) for name in self.tool_names)
            return False if maybe and not final else self._leave_block(out)
        j = _skip_space(self.text, newline + 1)
        if line not in self.tool_names or (j < len(self.text) and self.text[j] != "{"):
            return self._leave_block(out)
        if j == len(self.text):
            return False if not final else self._leave_block(out)
        self._start_args(out, line, j, in_object=False)
        return True

    def _start_args(self, out: ParsedDelta, name: str, start: int, in_object: bool) -> None:
        self._send_header(out, name)
        self.state, self.in_object = "args", in_object
        self.args_start, self.scan = start, JsonScan(start, self.fmt.end)

    def _advance_args(self, out: ParsedDelta, final: bool) -> bool:
        self.scan.run(self.text)
        if self.scan.end is None:
            if not final:
                self._send_args(out, self._held_args())
            return False
        self._send_args(out, self.text[self.args_start : self.scan.end].rstrip())
        self.pos = self.scan.end
        if self.in_object:
            self.state = "tail"
        else:
            self._call_done()
        return True

    def _held_args(self) -> str:
        """What of unfinished arguments is safe to send: not a possible start of the end
        marker, nor trailing space."""
        partial = self.text[self.args_start : self.scan.pos]
        if not self.scan.in_string and self.fmt.end:
            partial = partial[: len(partial) - _partial_suffix(partial, self.fmt.end)]
        return partial.rstrip()

    def _advance_tail(self, final: bool) -> bool:
        """After the arguments: the call object's `}` (other keys after them are skipped)."""
        i = _skip_space(self.text, self.pos)
        if i == len(self.text) and not final:
            return False
        if i < len(self.text) and self.text[i] == "}":
            self.pos = i + 1
        elif i < len(self.text) and self.text[i] == ",":
            scan = JsonScan(i + 1, self.fmt.end, depth=1)
            scan.run(self.text)
            if scan.end is None and not final:
                return False
            self.pos = scan.end if scan.end is not None else len(self.text)
        self._call_done()
        return True

    def _call_done(self) -> None:
        self.block_calls += 1
        self.state, self.expect_call = "block", self.fmt.name_line

    # ------------------------------------------------------------------ output

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
        self.num_calls, self.args_sent = self.num_calls + 1, 0

    def _send_args(self, out: ParsedDelta, arguments: str) -> None:
        if len(arguments) > self.args_sent:
            out.calls.append(CallDelta(self.num_calls - 1, arguments[self.args_sent :]))
            self.args_sent = len(arguments)


_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


def _bare_call(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments) if text is one call to a known tool as bare or fenced JSON."""
    text = text.strip()
    fenced = _FENCE.fullmatch(text)
    call = _call_of(fenced.group(1) if fenced else text)
    return call if call is not None and call[0] in names else None


def _call_of(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) if text is a call object: `name` and `arguments` (or Llama's
    `parameters`) an object."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _json_string(quoted: str) -> str | None:
    try:
        value = json.loads(quoted)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _skip_space(text: str, pos: int) -> int:
    match = _SPACE.match(text, pos)
    return match.end() if match is not None else pos


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None
    calls: list[dict[str, Any]]  # OpenAI tool_calls: id, type, function {name, arguments}


def parse_message(
    text: str, tool_names: frozenset[str] = frozenset(), fmt: ToolFormat = HERMES
) -> ParsedMessage:
    """A whole response: content and tool calls, exactly as a stream would have sent them."""
    parser = ToolCallParser(fmt, tool_names)
    deltas = [parser.feed(text), parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[dict[str, Any]] = []
    for delta in (c for d in deltas for c in d.calls):
        if delta.id is not None:
            function = {"name": delta.name, "arguments": ""}
            calls.append({"id": delta.id, "type": "function", "function": function})
        calls[delta.index]["function"]["arguments"] += delta.arguments
    return ParsedMessage(content or None, calls)
