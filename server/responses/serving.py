"""/v1/responses: a Responses request runs as the chat request it converts to (same template,
grammar, tool parsing and sampling); its output becomes Responses items, whole, streamed as typed
events, or in the background. Stored responses continue through `previous_response_id`.

A stored response that streams or runs in the background is written when it starts, with its
output so far while it runs, and when it ends; one the server cannot finish ends `failed`
(server/responses/interrupted.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
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
from server.responses.interrupted import (
    CHECKPOINT_S,
    UNFINISHED,
    as_interrupted,
    stopped_error,
)
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

logger = logging.getLogger("specserve.server")
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
class Progress:
    """A streamed or background response while it runs: what it has produced so far."""

    choice: Choice
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    final: ResponseObject | None = None  # set once the engine has finished it
    saved_at: float = field(default_factory=time.monotonic)


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
        # Set once the server cuts what still runs (its grace period is over): a running
        # response ends at its next output, and one that ends unfinished from then on failed
        # (it was not cancelled); a stream's last event says so.
        self.stopping = False

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
        _check_continuable(req.previous_response_id, previous.response)
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
        builder.feed(whole_output(c.text, p.chat, self.tool_format))
        builder.finish(_item_status(c))
        return self._final(p, builder, c)

    def _final(self, p: Prepared, builder: OutputBuilder, c: Choice) -> ResponseObject:
        status = _status(c)
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
                "usage": _usage(c),
                "spec_decode": total_spec([c]),
            }
        )

    def _failed(self, p: Prepared, exc: BaseException, progress: Progress) -> ResponseObject:
        error = ResponseError(code="server_error", message=as_api_error(exc).message)
        return self._partial(p, progress, "failed").model_copy(update={"error": error})

    def _partial(self, p: Prepared, progress: Progress, status: str) -> ResponseObject:
        """The response with what it has produced so far: a checkpoint while it runs, or its
        end when it was cut (the open item closed as incomplete)."""
        if status != "in_progress":
            progress.builder.close("incomplete")
        return p.start.model_copy(
            update={
                "status": status,
                "output": [item.model_copy() for item in progress.builder.items],
                "usage": _usage(progress.choice),
            }
        )

    def _ending(self, p: Prepared, progress: Progress) -> ResponseObject:
        """How a streamed or background response is stored at its end: as the engine finished it,
        else (the client left, or the server cut it) with its output so far."""
        final = progress.final
        if final is not None and not (self.stopping and final.status == "cancelled"):
            return final
        if not self.stopping:
            return final or self._partial(p, progress, "cancelled")
        return self._partial(p, progress, "failed").model_copy(update={"error": stopped_error()})

    def _checkpoint(self, p: Prepared, progress: Progress) -> None:
        """Store the output so far, at most every CHECKPOINT_S: what survives a crash."""
        if p.req.store and time.monotonic() - progress.saved_at >= CHECKPOINT_S:
            self._save(p, self._partial(p, progress, "in_progress"))
            progress.saved_at = time.monotonic()

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
        """As a stream nobody reads: the same output, checkpointed the same way."""
        progress = Progress(Choice(p.jobs[0]))
        with self._running(p):
            try:
                async for _ in self._output_events(p, progress):
                    pass
            except Exception as exc:
                progress.final = self._failed(p, exc, progress)
            finally:
                self._save(p, self._ending(p, progress))

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
        progress = Progress(Choice(p.jobs[0]))
        with self._running(p):
            try:
                async for event in self._output_events(p, progress):
                    yield sse(event)
            except Exception as exc:
                progress.final = self._failed(p, exc, progress)
            finally:  # also when the client leaves or the server cuts the stream
                final = self._ending(p, progress)
                self._save(p, final)
        kind = _FINAL_EVENT.get(final.status, "response.failed")
        yield sse({"type": kind, "response": final.model_dump()})

    async def _output_events(self, p: Prepared, progress: Progress) -> AsyncIterator[Event]:
        """The stream's events; `progress` holds the output so far and, at the end, the final
        response."""
        builder, c = progress.builder, progress.choice
        async with aclosing(self.run(p.jobs)) as outputs:
            async for _, out in outputs:
                if self.stopping:  # cut: it ends now, stored (and streamed last) as failed
                    return
                # Here every earlier event has been taken (sent, for a stream), so a checkpoint
                # never holds text a client did not get.
                self._checkpoint(p, progress)
                c.add(out)
                for event in builder.feed(output_delta(c, out, p.chat, self.tool_format)):
                    yield event
        for event in builder.finish(_item_status(c)):
            yield event
        progress.final = self._final(p, builder, c)

    # ------------------------------------------------------------------ the server's life

    def fail_interrupted(self) -> int:
        """At start-up, before the server reports ready: every response an earlier process left
        queued or in progress becomes failed (its output so far kept). A store file that does
        not exist yet is not created; the memory store starts empty. A file SQLite cannot read
        is logged, not fatal: chat, completions and Messages still serve."""
        path = self.settings.response_store_file
        if path == ":memory:" or not Path(path).exists():
            return 0
        try:
            ids = self.store.rewrite_unfinished(as_interrupted)
        except sqlite3.DatabaseError as exc:
            logger.error(
                "the response store %s cannot be read (%s); /v1/responses fails", path, exc
            )
            return 0
        if ids:
            logger.warning(
                "%d stored responses were cut by an earlier stop of the server; now failed: %s",
                len(ids), ", ".join(ids[:10]) + (", ..." if len(ids) > 10 else ""),
            )  # fmt: skip
        return len(ids)

    async def close(self, timeout_s: float = 5.0) -> None:
        """At shutdown, once the engine has stopped: the background responses end (failed, as
        cut), and whatever is still unfinished in the store is failed too."""
        self.stopping = True
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)
        if self._store is not None:
            self._store.rewrite_unfinished(as_interrupted)

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


def _check_continuable(response_id: str, previous: dict[str, Any]) -> None:
    """Only a response that ended on its own can be continued: an unfinished one has no last
    turn yet, a failed one a cut-off turn."""
    status = previous.get("status")
    if status in UNFINISHED:
        raise APIError(
            400,
            f"Previous response with id '{response_id}' is still {status}; wait for it to finish.",
            "previous_response_id",
            "previous_response_in_progress",
        )
    if status == "failed":
        why = (previous.get("error") or {}).get("message", "")
        raise APIError(
            400,
            f"Previous response with id '{response_id}' failed and cannot be continued. {why}",
            "previous_response_id",
            "previous_response_failed",
        )


def _usage(c: Choice) -> ResponseUsage:
    usage = usage_of([c])
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details={"cached_tokens": cached},
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


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
