"""Stored responses the server could not finish: they end `failed`, never `in_progress` forever.

A stored response is written when it starts, every `CHECKPOINT_S` while it runs (its output so
far) and when it ends. A process that dies mid-response (SIGKILL, an OOM kill, a power cut)
leaves it `queued` or `in_progress` in the store, where nothing will ever finish it, and a client
polling it would wait without end. So at start-up, before /health reports ready, every such
response becomes `failed` with an error that says why, its partial output kept; a graceful stop
(SIGTERM) marks the responses it cuts after its grace period the same way before it exits.
"""

from __future__ import annotations

from typing import Any

from server.responses.protocol import ResponseError

# How often a running response's output is written to the store: what a crash can lose of it.
# Each write is one SQLite transaction of the response so far (WAL, no fsync), on the event loop.
CHECKPOINT_S = 0.5
UNFINISHED = ("queued", "in_progress")
STOPPED = (
    "The server stopped while this response was being generated; the output produced before "
    "it stopped is kept. Send the request again."
)


def stopped_error() -> ResponseError:
    """OpenAI's shape for a response the server failed to finish."""
    return ResponseError(code="server_error", message=STOPPED)


def as_interrupted(response: dict[str, Any]) -> dict[str, Any]:
    """A stored response (as GET returns it) left unfinished, as it reads once failed."""
    output = [_closed(item) for item in response.get("output", [])]
    return response | {
        "status": "failed",
        "error": stopped_error().model_dump(),
        "output": output,
        "completed_at": None,
    }


def _closed(item: dict[str, Any]) -> dict[str, Any]:
    return item | {"status": "incomplete"} if item.get("status") == "in_progress" else item
