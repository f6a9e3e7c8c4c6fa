"""Admission: whether a request may join the waiting queue, and when a refused client should
come back.

A waiting request is cheap: a tokenized prompt, a connection and a few objects. So the queue is
bounded by what it holds (an estimated memory per request, its prompt tokens included) and by how
long a newcomer would wait (the queue's drain time at the completion rate measured over the last
seconds), not by a small count; 429 is kept for when admitting would really hurt.

A refusal advises `Retry-After` from the same state: the time the waiting queue needs to drain,
spread per response over that window (a golden-ratio sequence, so the refusals of one burst come
back spread evenly across it rather than all in the same second, the thundering herd that a fixed
`Retry-After: 1` synchronizes). 503s while loading or draining are spread the same way.

The server counts what it admitted itself (a reservation per request from the check to the start
of its engine requests, then the requests until they finish): the engine's own queue lags behind
its inbox, and in a burst thousands of requests pass the check before the engine sees any.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from server.errors import APIError
from server.metrics import Metrics

# What one waiting request holds besides its prompt: its connection and the HTTP, serving and
# engine objects that carry it. The server's RSS grew 40 MiB with about 940 waiting (a storm of
# 1,000 on the tiny model, bench/serving/storm.py): 44 KiB each, rounded up.
REQUEST_BYTES = 48 * 1024
# A prompt token as the request holds it: a Python int in the request's few lists of ids.
TOKEN_BYTES = 160
# The openai SDK honours a Retry-After of up to 120 s (and gives up beyond); a minute keeps a
# refused client within a sensible wait and within every common client's range.
RETRY_AFTER_MAX_S = 60
RETRY_AFTER_MIN_S = 1
# A loading or draining server has no queue to measure: a router retries elsewhere meanwhile.
UNAVAILABLE_S = 10.0
WINDOW_S = 10.0  # completions counted over this many seconds for the drain rate
RESERVATION_TTL_S = 30.0  # a reservation whose requests never started (client left) expires
GOLDEN = (math.sqrt(5) - 1) / 2  # successive fractions {u + k·GOLDEN} cover [0, 1) evenly

Reason = Literal["requests", "memory", "wait"]  # metrics.REFUSAL_REASONS


class EngineLoad(Protocol):
    """What admission reads of the engine (AsyncLLM, or a test's fake); AsyncLLM's
    `max_num_seqs` too, where an engine has one."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


@dataclass(frozen=True)
class AdmissionConfig:
    max_waiting_requests: int | None = None  # a fixed cap, if the operator wants one
    max_waiting_bytes: int = 1 << 30
    max_queue_wait_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: object) -> AdmissionConfig:
        gib = float(getattr(settings, "max_waiting_gib", 1.0))
        return cls(
            max_waiting_requests=getattr(settings, "max_waiting_requests", None),
            max_waiting_bytes=int(gib * (1 << 30)),
            max_queue_wait_s=float(getattr(settings, "max_queue_wait_s", 300.0)),
        )


def request_bytes(num_prompt_tokens: int) -> int:
    """The memory one waiting request is estimated to hold."""
    return REQUEST_BYTES + TOKEN_BYTES * num_prompt_tokens


class CompletionRate:
    """Requests finished per second over the last `window_s` seconds of the current busy period
    (since the server last held no request): an idle minute before a storm is no slow rate."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self.busy_since = clock()
        self.events: deque[tuple[float, int]] = deque()  # (time, requests finished)
        self.total = 0

    def busy_from(self, now: float) -> None:
        """The server takes a request while holding none: a new busy period starts."""
        self.busy_since = now
        self.events.clear()
        self.total = 0

    def record(self, finished: int) -> None:
        if finished > 0:
            self.events.append((self.clock(), finished))
            self.total += finished

    def per_second(self) -> float | None:
        """None until a request has finished within the window."""
        now = self.clock()
        while self.events and self.events[0][0] < now - self.window_s:
            self.total -= self.events.popleft()[1]
        if not self.events:
            return None
        span = max(1.0, now - max(now - self.window_s, self.busy_since))
        return self.total / span


class Spread:
    """Retry-After values spread evenly over a window: each response takes the next point of
    a golden-ratio sequence (random start), so any run of refusals covers the window."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.u = (rng or random.Random()).random()

    def seconds(self, window_s: float) -> int:
        """A whole number of seconds in [1, min(window_s, RETRY_AFTER_MAX_S)] (at least 1)."""
        self.u = (self.u + GOLDEN) % 1.0
        top = min(max(window_s, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
        value = RETRY_AFTER_MIN_S + self.u * (top - RETRY_AFTER_MIN_S)
        return min(max(math.ceil(value), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)


@dataclass
class Held:
    """What the server admitted and has not seen finish: reservations, then running jobs."""

    reserved: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (time, bytes)
    started: dict[str, int] = field(default_factory=dict)  # id -> bytes
    num_bytes: int = 0

    def reserve(self, ids_bytes: Iterable[tuple[str, int]], now: float) -> None:
        for request_id, size in ids_bytes:
            if request_id in self.reserved:
                self.num_bytes -= self.reserved[request_id][1]
            self.reserved[request_id] = (now, size)
            self.num_bytes += size

    def start(self, ids_bytes: Iterable[tuple[str, int]]) -> None:
        for request_id, size in ids_bytes:
            if request_id in self.reserved:
                self.num_bytes -= self.reserved.pop(request_id)[1]
            self.num_bytes += size - self.started.get(request_id, 0)
            self.started[request_id] = size

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.num_bytes -= self.started.pop(request_id, 0)

    def expire(self, before: float) -> None:
        stale = [r for r, (t, _) in self.reserved.items() if t < before]
        for request_id in stale:
            self.num_bytes -= self.reserved.pop(request_id)[1]

    @property
    def count(self) -> int:
        return len(self.reserved) + len(self.started)


@dataclass(frozen=True)
class Refusal:
    reason: Reason
    message: str


class Admission:
    """One per server, shared by every endpoint; runs on the event loop only (no locks)."""

    def __init__(
        self,
        config: AdmissionConfig,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self.rate = CompletionRate(clock=clock)
        self.spread = Spread(rng)
        self.held = Held()

    # ---- the queue's state -------------------------------------------------------------------

    def num_waiting(self, engine: EngineLoad) -> int:
        """Admitted and not yet running: the engine's count, or the server's if it knows more
        (requests still on their way to the engine, beyond what the running batch can take)."""
        batch = max(engine.num_running, getattr(engine, "max_num_seqs", 0))
        return max(engine.num_waiting, self.held.count - batch)

    def drain_s(self, engine: EngineLoad) -> float | None:
        """Seconds for the waiting queue to drain at the measured completion rate; None until a
        request has finished in the last window."""
        rate = self.rate.per_second()
        return None if rate is None else self.num_waiting(engine) / rate

    def refusal(self, engine: EngineLoad, new_bytes: int) -> Refusal | None:
        """Why a request holding `new_bytes` may not join the queue now, or None."""
        waiting = self.num_waiting(engine)
        cap = self.config.max_waiting_requests
        if cap is not None and waiting >= cap:
            return Refusal("requests", f"too many requests waiting ({waiting}); retry later")
        if waiting and self.held.num_bytes + new_bytes > self.config.max_waiting_bytes:
            mib = self.held.num_bytes / (1 << 20)
            return Refusal("memory", f"the waiting queue is full ({waiting} hold {mib:.0f} MiB)")
        drain = self.drain_s(engine)
        if drain is not None and drain > self.config.max_queue_wait_s:
            return Refusal("wait", f"the queue would take {drain:.0f} s to reach this request")
        return None

    # ---- decisions ---------------------------------------------------------------------------

    def refuse_if_full(self, engine: EngineLoad, surely_valid: Callable[[], bool]) -> None:
        """The cheap refusal, before a request is tokenized: raise 429 when even the smallest
        request would be refused and `surely_valid()` proves this one is no 400 (it is called
        only then, so a request that is not refused costs nothing more)."""
        refusal = self.refusal(engine, request_bytes(0))
        if refusal is not None and surely_valid():
            raise self._refused(refusal, engine)

    def admit(self, engine: EngineLoad, jobs: Iterable[tuple[str, int]]) -> None:
        """Reserve room for a validated request's jobs (request id, prompt tokens), or 429."""
        now = self.clock()
        self.held.expire(now - RESERVATION_TTL_S)
        if self.held.count == 0:
            self.rate.busy_from(now)
        sized = [(request_id, request_bytes(n)) for request_id, n in jobs]
        refusal = self.refusal(engine, sum(size for _, size in sized))
        if refusal is not None:
            raise self._refused(refusal, engine)
        self.held.reserve(sized, now)

    def started(self, jobs: Iterable[tuple[str, int]]) -> None:
        """The jobs' engine requests are starting (turns their reservations into holdings)."""
        self.held.start((request_id, request_bytes(n)) for request_id, n in jobs)

    def finished(self, request_ids: Iterable[str], num_completed: int) -> None:
        """The jobs are done (`num_completed` of them ran to the end; the rest were aborted)."""
        self.held.release(request_ids)
        self.rate.record(num_completed)

    # ---- advice ------------------------------------------------------------------------------

    def retry_after(self, engine: EngineLoad) -> int:
        """Seconds a refused client should wait: spread over the queue's drain time (before any
        request finished, a guess of one request per running slot per second)."""
        drain = self.drain_s(engine)
        if drain is None:
            drain = self.num_waiting(engine) / max(1, engine.num_running)
        return self.spread.seconds(drain)

    def retry_after_unavailable(self) -> int:
        """Seconds a client should wait on a 503 (loading, draining, dead engine)."""
        seconds = self.spread.seconds(UNAVAILABLE_S)
        if self.metrics is not None:
            self.metrics.observe_retry_after(seconds, 503)
        return seconds

    def _refused(self, refusal: Refusal, engine: EngineLoad) -> APIError:
        seconds = self.retry_after(engine)
        if self.metrics is not None:
            self.metrics.count_refused(refusal.reason)
            self.metrics.observe_retry_after(seconds, 429)
        return APIError(429, refusal.message, code="rate_limit_exceeded", retry_after=seconds)
