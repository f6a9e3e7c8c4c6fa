"""/v1/responses: a Responses request runs as the chat request it converts to (same template,
grammar, tool parsing and sampling); its output becomes Responses items, whole, streamed as typed
events, or in the background. Stored responses continue through `previous_response_id`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from starlette.requests import Request

from server.errors import APIError, bad_request
from server.metrics import Metrics
from server.openai.chat import OpenAIServingChat, output_delta, whole_output
from server.openai.protocol import ChatCompletionRequest, now
from server.openai.serving import Choice, Job, Stream, as_api_error, total_spec, usage_of
from server.request_body import validation_error
from server.responses.events import Event, OutputBuilder
from server.responses.protocol import (
    IncompleteDetails,
    ResponseError,
    ResponseItemList,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    item_id,
    to_chat_messages,
)
from server.responses.store import ResponseStore, StoredResponse
from server.settings import Settings

if TYPE_CHECKING:
    from engine.core.async_engine import AsyncLLM

_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}
_FINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


@dataclass
class Prepared:
    """A validated request, ready to run: its chat form, engine jobs and first response."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    jobs: list[Job]
    start: ResponseObject
    stored: StoredResponse  # input items and history; the response is filled in as it runs
    owner: str


@dataclass
class Running:
    request_ids: list[str]
    done: asyncio.Event = field(default_factory=asyncio.Event)


def not_found(response_id: str) -> APIError:
    return APIError(
        404, f"No response found with id '{response_id}'.", "response_id", "response_not_found"
    )


class OpenAIServingResponses(OpenAIServingChat):
    endpoint = "responses"

    def __init__(self, engine: AsyncLLM, settings: Settings, metrics: Metrics) -> None:
        super().__init__(engine, settings, metrics)
        self._store: ResponseStore | None = None
        self.running: dict[str, Running] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def store(self) -> ResponseStore:
        """Opened at first use, so a server that never serves /v1/responses writes no file."""
        if self._store is None:
            s = self.settings
            self._store = ResponseStore(
                s.response_store_file, s.response_store_max, s.response_store_retention_s
            )
        return self._store

    # ------------------------------------------------------------------ create

    async def prepare(self, req: ResponsesRequest, owner: str) -> Prepared:
        history = self._history(req, owner)
        inputs = [
            _stored_item(item.model_dump(by_alias=True, exclude_none=True))
            for item in req.input_items
        ]
        try:
            messages = to_chat_messages(req.instructions, [*history, *inputs], len(history))
            chat = req.to_chat_request(messages)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        except ValueError as exc:
            raise bad_request(str(exc), "input") from None
        response_id = item_id("resp")
        jobs = await self.chat_jobs(chat, response_id)
        start = ResponseObject.start(req, response_id, self.model_name, now())
        return Prepared(req, chat, jobs, start, StoredResponse({}, inputs, history), owner)

    def _history(self, req: ResponsesRequest, owner: str) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        previous = self.store.get(req.previous_response_id, owner)
        if previous is None:
            raise APIError(
                400,
                f"Previous response with id '{req.previous_response_id}' not found.",
                "previous_response_id",
                "previous_response_not_found",
            )
        if previous.response.get("status") in ("queued", "in_progress"):
            raise bad_request("the previous response is still in progress", "previous_response_id")
        return previous.context

    async def create_response(self, p: Prepared, raw: Request) -> ResponseObject:
        if p.req.background:
            return self._start_background(p)
        with self._running(p):
            (choice,) = await self.collect(raw, p.jobs)
            response = self._whole(p, choice)
            self._save(p, response)
        return response

    def _whole(self, p: Prepared, c: Choice) -> ResponseObject:
        builder = OutputBuilder()
        builder.feed(whole_output(c.text, p.chat))
        builder.finish(_item_status(c))
        return self._final(p, builder, c)

    def _final(self, p: Prepared, builder: OutputBuilder, c: Choice) -> ResponseObject:
        status = _status(c)
        usage = usage_of([c])
        cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
        return p.start.model_copy(
            update={
                "status": status,
                "completed_at": now() if status == "completed" else None,
                "incomplete_details": (
                    IncompleteDetails(reason="max_output_tokens")
                    if status == "incomplete"
                    else None
                ),
                "output": builder.items,
                "usage": ResponseUsage(
                    input_tokens=usage.prompt_tokens,
                    input_tokens_details={"cached_tokens": cached},
                    output_tokens=usage.completion_tokens,
                    total_tokens=usage.total_tokens,
                ),
                "spec_decode": total_spec([c]),
            }
        )

    def _failed(self, p: Prepared, exc: BaseException) -> ResponseObject:
        error = ResponseError(code="server_error", message=as_api_error(exc).message)
        return p.start.model_copy(update={"status": "failed", "error": error})

    def _save(self, p: Prepared, response: ResponseObject) -> None:
        if p.req.store:
            stored = StoredResponse(response.model_dump(), p.stored.input_items, p.stored.history)
            self.store.put(response.id, p.owner, stored)

    def _running(self, p: Prepared) -> _Registered:
        return _Registered(self.running, p.start.id, [job.request_id for job in p.jobs])

    # ------------------------------------------------------------------ background

    def _start_background(self, p: Prepared) -> ResponseObject:
        self._save(p, p.start)
        task = asyncio.create_task(self._run_background(p))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return p.start

    async def _run_background(self, p: Prepared) -> None:
        with self._running(p):
            try:
                (choice,) = await self._collect(p.jobs)
                response = self._whole(p, choice)
            except Exception as exc:
                response = self._failed(p, exc)
            self._save(p, response)

    # ------------------------------------------------------------------ streaming

    def stream_response(self, p: Prepared) -> Stream:
        return Stream(self._events(p), [job.request_id for job in p.jobs])

    async def _events(self, p: Prepared) -> AsyncIterator[dict[str, str]]:
        numbers = itertools.count()

        def sse(event: Event) -> dict[str, str]:
            event["sequence_number"] = next(numbers)
            return {"event": event["type"], "data": json.dumps(event, ensure_ascii=False)}

        self._save(p, p.start)
        first = p.start.model_dump()
        yield sse({"type": "response.created", "response": first})
        yield sse({"type": "response.in_progress", "response": first})
        final = p.start.model_copy(update={"status": "cancelled"})  # if the client leaves
        with self._running(p):
            try:
                async for event in self._output_events(p):
                    if isinstance(event, ResponseObject):
                        final = event
                    else:
                        yield sse(event)
            except Exception as exc:
                final = self._failed(p, exc)
            finally:
                self._save(p, final)
        kind = _FINAL_EVENT.get(final.status, "response.failed")
        yield sse({"type": kind, "response": final.model_dump()})

    async def _output_events(self, p: Prepared) -> AsyncIterator[Event | ResponseObject]:
        builder, c = OutputBuilder(), Choice(p.jobs[0])
        async with aclosing(self.run(p.jobs)) as outputs:
            async for _, out in outputs:
                c.add(out)
                for event in builder.feed(output_delta(c, out, p.chat)):
                    yield event
        for event in builder.finish(_item_status(c)):
            yield event
        yield self._final(p, builder, c)

    # ------------------------------------------------------------------ stored responses

    def get(self, response_id: str, owner: str) -> StoredResponse:
        stored = self.store.get(response_id, owner)
        if stored is None:
            raise not_found(response_id)
        return stored

    def delete(self, response_id: str, owner: str) -> None:
        if not self.store.delete(response_id, owner):
            raise not_found(response_id)

    def input_items(
        self, response_id: str, owner: str, limit: int, order: str, after: str | None
    ) -> ResponseItemList:
        items = self.get(response_id, owner).input_items
        items = items[::-1] if order == "desc" else items
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise bad_request(f"no input item with id '{after}'", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return ResponseItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > limit,
        )

    async def cancel(self, response_id: str, owner: str) -> dict[str, Any]:
        """Abort a running background or streamed response; its stored status turns cancelled."""
        stored = self.get(response_id, owner)
        running = self.running.get(response_id)
        if running is None:
            status = stored.response.get("status")
            raise bad_request(f"response {response_id} is not in progress (status {status})")
        for request_id in running.request_ids:
            await self.abort(request_id)
        await asyncio.wait_for(running.done.wait(), timeout=self.settings.shutdown_grace_s + 5)
        return self.get(response_id, owner).response


class _Registered:
    """While a response runs, `running` names its engine requests (for cancel)."""

    def __init__(self, running: dict[str, Running], response_id: str, ids: list[str]) -> None:
        self.running, self.response_id = running, response_id
        self.entry = Running(ids)

    def __enter__(self) -> Running:
        self.running[self.response_id] = self.entry
        return self.entry

    def __exit__(self, *exc: object) -> None:
        self.running.pop(self.response_id, None)
        self.entry.done.set()


def _status(c: Choice) -> str:
    if c.finish_reason == "length":
        return "incomplete"
    return "cancelled" if c.finish_reason == "abort" else "completed"


def _item_status(c: Choice) -> Any:
    return "completed" if _status(c) == "completed" else "incomplete"


def _stored_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as stored and listed: with an id, a message's text as content parts."""
    kind = item.get("type", "message")
    item = {"id": item_id(_ITEM_PREFIX[kind])} | item | {"type": kind}
    if kind == "message" and isinstance(item["content"], str):
        part = "output_text" if item["role"] == "assistant" else "input_text"
        item["content"] = [{"type": part, "text": item["content"]}]
    if kind == "message":
        item.setdefault("status", "completed")
    return item
