"""The Responses API's output, built from content and tool-call fragments: the output items and,
as they grow, the typed stream events (`response.output_item.added`, `...output_text.delta`, ...).

A whole response and a stream go through the same builder (the whole one in one fragment), so
the streamed events always add up to the non-streamed output.
"""

from __future__ import annotations

from typing import Any, Literal

from server.openai.tool_parser import CallDelta, ParsedDelta
from server.responses.protocol import OutputFunctionCall, OutputItem, OutputMessage, OutputText

Event = dict[str, Any]
ItemStatus = Literal["completed", "incomplete"]


class OutputBuilder:
    """Output items in order; at most one (the last) is still open."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None

    def feed(self, delta: ParsedDelta) -> list[Event]:
        events = self._text(delta.content) if delta.content else []
        for call in delta.calls:
            if call.id is not None:
                events += self.close("completed")
                events += self._open_call(call)
            if call.arguments:
                events += self._arguments(call.arguments)
        return events

    def finish(self, status: ItemStatus) -> list[Event]:
        """Close the last item; a response with no output at all gets an empty message."""
        events = [] if self.items else self._open_message()
        return events + self.close(status)

    # ------------------------------------------------------------------ items

    def _open_message(self) -> list[Event]:
        item = OutputMessage()
        events = self._add(item)
        item.content.append(OutputText(text=""))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self._at(item, "response.content_part.added", content_index=0, part=part))
        return events

    def _text(self, text: str) -> list[Event]:
        events = [] if isinstance(self.open, OutputMessage) else self.close("completed")
        if not isinstance(self.open, OutputMessage):
            events += self._open_message()
        message = self.open
        assert isinstance(message, OutputMessage)
        message.content[0].text += text
        events.append(
            self._at(
                message, "response.output_text.delta", content_index=0, delta=text, logprobs=[]
            )
        )
        return events

    def _open_call(self, call: CallDelta) -> list[Event]:
        assert call.id is not None and call.name is not None
        return self._add(OutputFunctionCall(call_id=call.id, name=call.name))

    def _arguments(self, text: str) -> list[Event]:
        item = self.open
        assert isinstance(item, OutputFunctionCall)
        item.arguments += text
        return [self._at(item, "response.function_call_arguments.delta", delta=text)]

    def _add(self, item: OutputItem) -> list[Event]:
        self.items.append(item)
        self.open = item
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1}
        return [added | {"item": item.model_dump()}]

    def close(self, status: ItemStatus) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        events = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            text = part.text
            events.append(self._at(item, "response.output_text.done", content_index=0, text=text))
            events[-1]["logprobs"] = []
            events.append(
                self._at(
                    item, "response.content_part.done", content_index=0, part=part.model_dump()
                )
            )
        else:
            done = {"arguments": item.arguments, "name": item.name}
            events.append(self._at(item, "response.function_call_arguments.done", **done))
        item.status = status
        index = self.items.index(item)
        events.append(
            {"type": "response.output_item.done", "output_index": index, "item": item.model_dump()}
        )
        return events

    def _at(self, item: OutputItem, kind: str, **fields: Any) -> Event:
        index = self.items.index(item)
        return {"type": kind, "item_id": item.id, "output_index": index} | fields
