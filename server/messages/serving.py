"""/v1/messages (Anthropic Messages): the request runs as the chat request it converts to; its
output becomes content blocks (`text`, `tool_use`), whole or streamed as Anthropic's events.

Like the Responses API's builder, one `BlockBuilder` makes both: a whole message is its stream
in one fragment, so the two always agree.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request

from server.errors import bad_request
from server.messages.protocol import (
    MessagesRequest,
    MessagesResponse,
    StopReason,
    Usage,
    message_id,
)
from server.openai.chat import OpenAIServingChat, output_delta, whole_output
from server.openai.protocol import ChatCompletionRequest
from server.openai.serving import Choice, Job, Stream, as_api_error, total_spec
from server.openai.tool_parser import ParsedDelta
from server.request_body import validation_error

Event = dict[str, Any]


class BlockBuilder:
    """Content blocks in order; the last may still be open (its index is `len(blocks) - 1`)."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.arguments: dict[int, str] = {}  # tool_use block index -> its input as JSON text
        self.open = False

    def feed(self, delta: ParsedDelta) -> list[Event]:
        events = self._text(delta.content) if delta.content else []
        for call in delta.calls:
            if call.id is not None:
                events += self.close()
                use: dict[str, Any] = {
                    "type": "tool_use",
                    "id": call.id,
                    "name": call.name,
                    "input": {},
                }
                events += self._start(use | {"caller": {"type": "direct"}})
                self.arguments[len(self.blocks) - 1] = ""
            if call.arguments:
                self.arguments[len(self.blocks) - 1] += call.arguments
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                )
        return events

    @property
    def has_tool_use(self) -> bool:
        return bool(self.arguments)

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if not (self.open and self.blocks[-1]["type"] == "text"):
            events = self.close() + self._start({"type": "text", "text": "", "citations": None})
        self.blocks[-1]["text"] += text
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _start(self, block: dict[str, Any]) -> list[Event]:
        self.blocks.append(block)
        self.open = True
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        return [start | {"content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def close(self) -> list[Event]:
        if not self.open:
            return []
        self.open = False
        index = len(self.blocks) - 1
        if index in self.arguments:
            self.blocks[index]["input"] = _tool_input(self.arguments[index])
        return [{"type": "content_block_stop", "index": index}]


def _tool_input(arguments: str) -> dict[str, Any]:
    """The call's arguments as an object ({} when the model's JSON is not one)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class AnthropicServingMessages(OpenAIServingChat):
    endpoint = "messages"

    async def prepare(self, req: MessagesRequest) -> tuple[ChatCompletionRequest, list[Job]]:
        chat = self.chat_request(req)
        return chat, await self.chat_jobs(chat, message_id())

    def chat_request(self, req: MessagesRequest) -> ChatCompletionRequest:
        try:
            return req.to_chat_request()
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None

    def count_tokens(self, req: MessagesRequest) -> dict[str, int]:
        text = self.chat_prompt(self.chat_request(req))
        return {"input_tokens": len(self.tokenizer.encode(text, add_special_tokens=False))}

    async def create_message(
        self, chat: ChatCompletionRequest, jobs: list[Job], raw: Request
    ) -> MessagesResponse:
        (c,) = await self.collect(raw, jobs)
        builder = BlockBuilder()
        builder.feed(whole_output(c.text, chat, self.tool_format))
        builder.close()
        reason, sequence = stop_reason(c, builder.has_tool_use, chat)
        return MessagesResponse(
            id=_message_id(jobs),
            model=self.model_name,
            content=builder.blocks,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=_usage(c),
            spec_decode=total_spec([c]),
        )

    def stream_message(self, chat: ChatCompletionRequest, jobs: list[Job]) -> Stream:
        return Stream(self._events(chat, jobs), [job.request_id for job in jobs])

    async def _events(
        self, chat: ChatCompletionRequest, jobs: list[Job]
    ) -> AsyncIterator[dict[str, str]]:
        start = MessagesResponse(
            id=_message_id(jobs),
            model=self.model_name,
            content=[],
            usage=Usage(input_tokens=len(jobs[0].prompt_ids), output_tokens=0),
        )
        yield _sse({"type": "message_start", "message": start.model_dump(exclude={"spec_decode"})})
        yield _sse({"type": "ping"})
        builder, c = BlockBuilder(), Choice(jobs[0])
        try:
            async with aclosing(self.run(jobs)) as outputs:
                async for _, out in outputs:
                    c.add(out)
                    for event in builder.feed(output_delta(c, out, chat, self.tool_format)):
                        yield _sse(event)
        except Exception as exc:
            yield _sse(as_api_error(exc).anthropic_body())
            return
        for event in builder.close():
            yield _sse(event)
        reason, sequence = stop_reason(c, builder.has_tool_use, chat)
        usage = _usage(c).model_dump(exclude={"cache_creation", "inference_geo", "service_tier"})
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield _sse(
            {
                "type": "message_delta",
                "delta": delta | {"stop_details": None, "container": None},
                "usage": usage,
                "spec_decode": total_spec([c]).model_dump(),
            }
        )
        yield _sse({"type": "message_stop"})


def stop_reason(
    c: Choice, has_tool_use: bool, chat: ChatCompletionRequest
) -> tuple[StopReason, str | None]:
    """Anthropic's reason, and the stop sequence that matched if one did."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    stops = chat.stop_list or ()
    if isinstance(c.stop_reason, str) and c.stop_reason in stops:
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(c: Choice) -> Usage:
    """Anthropic counts prompt tokens read from the cache apart from `input_tokens`."""
    prompt = c.num_prompt_tokens or len(c.job.prompt_ids)
    return Usage(
        input_tokens=prompt - c.num_cached_tokens,
        output_tokens=len(c.token_ids),
        cache_read_input_tokens=c.num_cached_tokens,
    )


def _message_id(jobs: list[Job]) -> str:
    return jobs[0].request_id.rsplit("-", 1)[0]


def _sse(event: Event) -> dict[str, str]:
    return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}
