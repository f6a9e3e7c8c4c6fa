"""Overload (server/admission.py): the waiting queue bounded by what it holds and how long it takes
to drain, Retry-After advised from that drain time and spread per response, refusals only for
valid requests (a malformed one is a 400), and the metrics that count them."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import FakeEngine, LiveServer, assert_error_shape, metric_value

from server.admission import (
    REQUEST_BYTES,
    RESERVATION_TTL_S,
    RETRY_AFTER_MAX_S,
    Admission,
    AdmissionConfig,
    Spread,
    request_bytes,
)
from server.app import create_app
from server.errors import APIError
from server.metrics import Metrics
from server.settings import Settings


@dataclass
class Load:
    """The engine's queue as admission reads it."""

    num_running: int = 0
    num_waiting: int = 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admission(clock: Clock, **config: Any) -> Admission:
    return Admission(AdmissionConfig(**config), Metrics("m"), clock, random.Random(0))


def measured(clock: Clock, rate_per_s: int, **config: Any) -> Admission:
    """An admission that saw `rate_per_s` requests finish each second for ten seconds."""
    adm = admission(clock, **config)
    adm.admit(Load(), [("busy", 1)])  # type: ignore[arg-type]  # held throughout: one busy period
    for _ in range(10):
        clock.now += 1.0
        adm.finished([], rate_per_s)
    return adm


def advice(adm: Admission, load: Load, n: int = 40) -> list[int]:
    return [adm.retry_after(load) for _ in range(n)]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- the advice


def test_spread_covers_the_window_and_successive_values_differ() -> None:
    spread = Spread(random.Random(1))
    values = [spread.seconds(30.0) for _ in range(30)]
    assert all(1 <= v <= 30 for v in values)
    assert all(a != b for a, b in zip(values, values[1:], strict=False)), values
    assert min(values) <= 3 and max(values) >= 28, "a burst's retries spread over the window"
    assert {spread.seconds(0.2) for _ in range(10)} == {1}, "never below one second"
    capped = [spread.seconds(10_000.0) for _ in range(50)]
    assert max(capped) <= RETRY_AFTER_MAX_S and max(capped) >= RETRY_AFTER_MAX_S - 3, "capped"


def test_retry_after_is_the_queue_drain_time_and_grows_with_the_queue() -> None:
    clock = Clock()
    adm = measured(clock, rate_per_s=5)
    assert adm.drain_s(Load(num_waiting=100)) == pytest.approx(20.0)  # type: ignore[arg-type]
    short = advice(adm, Load(num_running=4, num_waiting=20))  # drains in 4 s
    long = advice(adm, Load(num_running=4, num_waiting=200))  # drains in 40 s
    assert max(short) <= 4 and max(long) <= 40
    assert statistics.mean(long) > 4 * statistics.mean(short)
    assert len(set(long)) > 20, "one burst's refusals are told different times"


def test_retry_after_before_any_request_finished_guesses_from_the_running_batch() -> None:
    adm = admission(Clock())
    assert adm.drain_s(Load(num_running=8, num_waiting=80)) is None  # type: ignore[arg-type]
    assert max(advice(adm, Load(num_running=8, num_waiting=80))) <= 10
    assert max(advice(adm, Load(num_running=1, num_waiting=80))) > 40


def test_the_rate_forgets_what_finished_before_the_window() -> None:
    clock = Clock()
    adm = measured(clock, rate_per_s=5)
    clock.now += 60.0
    assert adm.rate.per_second() is None


def test_the_rate_is_measured_over_the_busy_period_not_the_idle_time_before() -> None:
    clock = Clock()
    adm = admission(clock)
    clock.now += 60.0  # idle
    adm.admit(Load(), [("first", 4)])  # type: ignore[arg-type]  # a burst starts
    for _ in range(4):
        clock.now += 0.5
        adm.finished([], 3)
    assert adm.rate.per_second() == pytest.approx(12 / 2.0)


# ---------------------------------------------------------------------------- the bounds


def test_the_queue_is_bounded_by_the_memory_it_holds_not_a_count() -> None:
    clock = Clock()
    adm = admission(clock, max_waiting_bytes=100 * REQUEST_BYTES)
    load = Load()
    for i in range(99):
        adm.admit(load, [(f"r{i}", 0)])  # type: ignore[arg-type]
    assert adm.num_waiting(load) == 99  # type: ignore[arg-type]
    with pytest.raises(APIError) as refused:
        adm.admit(load, [("big", 10_000)])  # type: ignore[arg-type]
    assert refused.value.status == 429 and "full" in refused.value.message
    adm.admit(load, [("small", 0)])  # type: ignore[arg-type]
    with pytest.raises(APIError):
        adm.admit(load, [("one-more", 0)])  # type: ignore[arg-type]


def test_an_empty_queue_takes_any_request() -> None:
    adm = admission(Clock(), max_waiting_bytes=REQUEST_BYTES)
    adm.admit(Load(), [("huge", 1_000_000)])  # type: ignore[arg-type]
    assert adm.held.num_bytes == request_bytes(1_000_000)


def test_holdings_follow_requests_from_reservation_to_finish() -> None:
    clock = Clock()
    adm = admission(clock)
    load = Load()
    adm.admit(load, [("a", 10), ("b", 20)])  # type: ignore[arg-type]
    adm.admit(load, [("c", 5)])  # type: ignore[arg-type]
    adm.started([("a", 10), ("b", 20)])
    assert adm.held.count == 3 and adm.held.num_bytes == sum(map(request_bytes, (10, 20, 5)))
    adm.finished(["a", "b"], 2)
    assert adm.held.count == 1
    clock.now += RESERVATION_TTL_S + 1  # "c"'s client left before its stream started
    adm.admit(load, [("d", 1)])  # type: ignore[arg-type]
    assert set(adm.held.reserved) == {"d"} and adm.held.num_bytes == request_bytes(1)


def test_a_queue_that_would_take_too_long_refuses_with_reason_wait() -> None:
    clock = Clock()
    adm = measured(clock, rate_per_s=2, max_queue_wait_s=30.0)
    adm.admit(Load(num_waiting=50), [("ok", 4)])  # type: ignore[arg-type]  # 25 s
    with pytest.raises(APIError) as refused:
        adm.admit(Load(num_waiting=70), [("late", 4)])  # type: ignore[arg-type]  # 35 s
    assert refused.value.retry_after is not None and 1 <= refused.value.retry_after <= 35
    text = adm.metrics.render().decode()  # type: ignore[union-attr]
    assert metric_value(text, "specserve:request_refused_total", reason="wait") == 1
    assert metric_value(text, "specserve:request_refused_total", reason="memory") == 0


def test_a_fixed_cap_still_applies_when_set() -> None:
    adm = admission(Clock(), max_waiting_requests=3)
    with pytest.raises(APIError):
        adm.admit(Load(num_waiting=3), [("x", 1)])  # type: ignore[arg-type]
    adm.admit(Load(num_waiting=2), [("y", 1)])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[tuple[LiveServer, FakeEngine, Any]]:
    from transformers import AutoTokenizer

    engine = FakeEngine(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", max_waiting_requests=8)
    app = create_app(engine, settings)  # type: ignore[arg-type]
    with LiveServer(app) as server:
        yield server, engine, app


@pytest.fixture
def full(live: tuple[LiveServer, FakeEngine, Any]) -> Iterator[httpx.Client]:
    """The fake engine reports a queue of 300 waiting behind one running request."""
    server, engine, _ = live
    engine.num_waiting, engine.num_running = 300, 1
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            yield http
    finally:
        engine.num_waiting, engine.num_running = 0, 0


def refusals(http: httpx.Client, path: str, body: dict[str, Any], n: int) -> list[int]:
    advised = []
    for _ in range(n):
        r = http.post(path, json=body)
        assert r.status_code == 429, r.text
        assert assert_error_shape(r.json(), 429)["type"] == "rate_limit_error"
        advised.append(int(r.headers["retry-after"]))
    return advised


def test_refusals_of_one_burst_are_told_different_times(full: httpx.Client) -> None:
    completion = {"prompt": "hi", "max_tokens": 4}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    advised = refusals(full, "/v1/completions", completion, 10)
    advised += refusals(full, "/v1/chat/completions", chat, 10)
    assert all(1 <= s <= RETRY_AFTER_MAX_S for s in advised)
    assert all(a != b for a, b in zip(advised, advised[1:], strict=False)), advised
    assert len(set(advised)) >= 15


def test_a_malformed_or_invalid_body_is_a_400_never_a_429(
    full: httpx.Client, live: tuple[LiveServer, FakeEngine, Any]
) -> None:
    before = full.get("/metrics").text
    bad: list[tuple[str, bytes | dict[str, Any]]] = [
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4'),
        ("/v1/completions", b'{"prompt": "\\udcff"}'),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "four"}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}),
        ("/v1/completions", {"prompt": "🦀" * 100}),  # beyond the window once tokenized
        ("/v1/completions", {"prompt": "hi", "guided_regex": "("}),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    ]
    for path, body in bad:
        if isinstance(body, bytes):
            r = full.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = full.post(path, json=body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert "retry-after" not in r.headers
    after = full.get("/metrics").text
    name = "specserve:request_refused_total"
    assert metric_value(after, name, reason="requests") == metric_value(
        before, name, reason="requests"
    ), "no refusal was counted for a bad request"


class NoTokenizing:
    """A tokenizer that fails the test if the request gets as far as tokenizing."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a request the queue could not take was tokenized")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_a_full_queue_refuses_a_completion_before_tokenizing_it(
    full: httpx.Client, live: tuple[LiveServer, FakeEngine, Any]
) -> None:
    completions = live[2].state.server.serving.completions
    real = completions.tokenizer
    completions.tokenizer = NoTokenizing(real)
    try:
        refusals(full, "/v1/completions", {"prompt": "Hello there", "max_tokens": 4}, 3)
        refusals(full, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4}, 1)
    finally:
        completions.tokenizer = real


def test_refusals_and_advice_are_counted(full: httpx.Client) -> None:
    def counts() -> tuple[float, float, float]:
        text = full.get("/metrics").text
        refused = metric_value(text, "specserve:request_refused_total", reason="requests")
        advised = metric_value(text, "specserve:retry_after_seconds_count", status="429")
        total = metric_value(text, "specserve:retry_after_seconds_sum", status="429")
        return refused, advised, total

    refused, advised, total = counts()
    seconds = refusals(full, "/v1/completions", {"prompt": "hi", "max_tokens": 4}, 5)
    after = counts()
    assert after[0] - refused == 5 and after[1] - advised == 5
    assert after[2] - total == pytest.approx(sum(seconds))


def test_goodput_counts_the_tokens_of_finished_requests(
    live: tuple[LiveServer, FakeEngine, Any],
) -> None:
    server = live[0]
    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = metric_value(http.get("/metrics").text, "specserve:goodput_tokens_total")
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        after = metric_value(http.get("/metrics").text, "specserve:goodput_tokens_total")
    assert after - before == 6


def test_draining_503s_are_spread_too(live: tuple[LiveServer, FakeEngine, Any]) -> None:
    server, _, app = live
    body = {"prompt": "hi", "max_tokens": 2}
    app.state.server.shutting_down = True
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            advised = []
            for _ in range(6):
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 503
                advised.append(int(r.headers["retry-after"]))
            health = http.get("/health")
            text = http.get("/metrics").text
    finally:
        app.state.server.shutting_down = False
    assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1
    assert all(1 <= s <= 10 for s in advised) and len(set(advised)) >= 4, advised
    assert metric_value(text, "specserve:retry_after_seconds_count", status="503") >= 7
