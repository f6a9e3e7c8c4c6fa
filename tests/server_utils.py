"""Server test helpers: a live uvicorn server on loopback, and a fake engine for failures
the real one cannot be made to produce (an engine loop that dies mid-stream)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from engine.core.async_engine import EngineDeadError
from engine.outputs import RequestOutput, RequestTimes, SpecStats, StepStats
from engine.sample.sampling_params import SamplingParams


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LiveServer:
    """uvicorn serving `app` in a thread on a free loopback port (lifespan included)."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@dataclass
class FakeEngine:
    """The AsyncLLM contract with scripted output: `tokens_per_step` tokens per step, each the
    next id of `script`; the loop can be made to die after `die_after_steps` steps."""

    tokenizer: Any
    model_name: str = "fake"
    max_model_len: int = 256
    script: list[int] = field(default_factory=lambda: list(range(100, 140)))
    tokens_per_step: int = 2
    step_s: float = 0.01
    die_after_steps: int | None = None
    started: bool = False
    stopped: bool = False
    dead: bool = False
    num_running: int = 0
    num_waiting: int = 0
    aborted: list[str] = field(default_factory=list)
    listeners: list[Callable[[StepStats], None]] = field(default_factory=list)

    @property
    def is_alive(self) -> bool:
        return self.started and not self.stopped and not self.dead

    async def start(self) -> None:
        self.started = True

    async def shutdown(self, grace_s: float = 0) -> None:
        self.stopped = True

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self.listeners.append(fn)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids or len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("the prompt is empty or too long")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError("engine loop died")
        times = RequestTimes(arrival=time.monotonic())
        spec = SpecStats()
        produced: list[int] = []
        self.num_running += 1
        try:
            for step in range(params.max_tokens):
                await asyncio.sleep(self.step_s)
                if self.die_after_steps is not None and step >= self.die_after_steps:
                    self.dead = True
                    raise EngineDeadError("engine loop died")
                new = self._next_tokens(produced, params.max_tokens)
                spec.add(self.tokens_per_step, len(new) - 1)
                produced += new
                yield self._output(request_id, prompt_token_ids, params, produced, new, spec, times)
                if len(produced) >= params.max_tokens:
                    return
        finally:
            self.num_running -= 1

    def _next_tokens(self, produced: list[int], max_tokens: int) -> list[int]:
        count = min(self.tokens_per_step, max_tokens - len(produced))
        return [self.script[(len(produced) + i) % len(self.script)] for i in range(count)]

    def _output(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        produced: list[int],
        new: list[int],
        spec: SpecStats,
        times: RequestTimes,
    ) -> RequestOutput:
        now = time.monotonic()
        times.first_scheduled = times.first_scheduled or times.arrival
        times.first_token = times.first_token or now
        finished = len(produced) >= params.max_tokens
        times.finished = now if finished else None
        for fn in self.listeners:
            fn(StepStats(self.num_running, 0, 0.1, 0, len(new), SpecStats(), 0, 0, 0))
        return RequestOutput(
            request_id=request_id,
            new_token_ids=new,
            new_text=self.tokenizer.decode(new),
            finished=finished,
            finish_reason="length" if finished else None,
            stop_reason=None,
            num_prompt_tokens=len(prompt),
            num_output_tokens=len(produced),
            num_cached_tokens=0,
            spec=copy.deepcopy(spec),
            times=times,
            step_time=now,
        )


class Throttle:
    """A step listener that slows the engine's loop (it runs on the engine thread), so a test can
    act while a request is surely still running. Off (0 s) by default."""

    def __init__(self) -> None:
        self.delay_s = 0.0

    def __call__(self, stats: StepStats) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)


@dataclass
class RealServer:
    url: str
    engine: Any
    settings: Any
    throttle: Throttle


@contextmanager
def real_server(model_dir: Path, **settings_kwargs: Any) -> Iterator[RealServer]:
    """The real AsyncLLM on the tiny model behind a live server (float32, n-gram speculation)."""
    from engine.core.async_engine import AsyncLLM
    from server.app import create_app
    from server.settings import Settings

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        served_model_name="tiny",
        dtype="float32",
        speculative_method="ngram",
        num_speculative_tokens=3,
        kv_cache_gib=0.02,
        max_num_seqs=4,
    )
    settings = Settings(**(kwargs | settings_kwargs))
    config = settings.engine_config()
    # Adaptive k follows measured timings, so the drafts (and unseeded draws) would not repeat.
    fixed_k = dataclasses.replace(config.speculative, adaptive=False)
    engine = AsyncLLM.from_config(
        dataclasses.replace(config, speculative=fixed_k), settings.model_name
    )
    throttle = Throttle()
    engine.add_step_listener(throttle)
    with LiveServer(create_app(engine, settings)) as live:
        yield RealServer(live.url, engine, settings, throttle)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.02)


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise KeyError(f"{name}{labels} not in the exposition")


def assert_error_shape(body: dict[str, Any], status: int) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert "Traceback" not in error["message"]
    return error
