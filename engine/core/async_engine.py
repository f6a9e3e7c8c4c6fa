"""AsyncLLM: runs LLMEngine's step loop on the engine thread and streams each request's outputs.

The engine thread (engine.core.engine_thread) builds the engine and then runs its step loop, so
every torch op of the process runs on that one thread; the event loop only enqueues commands
(add, abort) and receives RequestOutputs through per-request asyncio queues, so a long forward
pass never blocks the API.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.engine_thread import EngineThread
from engine.core.llm_engine import LLMEngine
from engine.model.device import make_current
from engine.outputs import RequestOutput, StepStats
from engine.sample.sampling_params import SamplingParams

log = logging.getLogger("specserve.engine")


class EngineDeadError(RuntimeError):
    """The step loop has died; no request can be served any more."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine,
        model_name: str | None = None,
        thread: EngineThread[LLMEngine] | None = None,  # the thread that built `engine`
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_name = model_name or engine.config.model
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._listeners: list[Callable[[StepStats], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # An engine built elsewhere (tests) gets a thread of its own that only steps it.
        self._thread = thread or EngineThread(lambda: engine)
        self._started = False
        self._stopping = False
        self._accepting = True
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, model_name: str | None = None) -> AsyncLLM:
        """Build the engine on a new engine thread (blocking until it is loaded)."""
        thread = EngineThread(lambda: LLMEngine(config))
        return cls(thread.start_and_build(), model_name, thread)

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if not self._thread.is_alive():
            self._thread.start_and_build()
        self._thread.run_loop(self._run)
        self._started = True

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop admission, let running requests finish for up to grace_s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        for request_id in list(self._streams):
            await self.abort(request_id)
        await asyncio.sleep(0)
        self._stopping = True
        self._wake.set()
        self._thread.cancel()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 10)

    @property
    def is_alive(self) -> bool:
        return self._started and self._thread.is_alive() and self.error is None

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    @property
    def max_num_seqs(self) -> int:
        """How many requests may run at once: requests beyond it wait."""
        return self.engine.config.max_num_seqs

    @property
    def kv_cache_usage(self) -> float:
        return self.engine.block_manager.usage

    @property
    def num_unfinished_requests(self) -> int:
        """Requests whose streams are open: admitted, running or not yet delivered."""
        return len(self._streams)

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.block_manager.num_blocks

    def add_step_listener(self, fn: Callable[[StepStats], None]) -> None:
        self._listeners.append(fn)

    # ---- requests --------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self.error
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._send(_Add(request_id, list(prompt_token_ids), params))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, ValueError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(str(item)) from item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the caller went away (client disconnect) or the engine died
                self._send(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def _send(self, command: _Add | _Abort) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ---- the step loop (background thread) -------------------------------------------------

    def _run(self) -> None:
        try:
            make_current(self.engine.config.device)  # CUDA's current device is per thread
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._publish(outputs)
                if self.engine.last_stats is not None:
                    self._notify(self.engine.last_stats)
        except BaseException as exc:  # noqa: BLE001 - the loop must report any death to its callers
            log.exception("engine step loop died")
            self.error = exc
            for request_id in list(self._streams):
                self._deliver(request_id, exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                if command.request_id in self._streams:
                    self._add(command)
            else:
                output = self.engine.abort(command.request_id)
                if output is not None:
                    self._publish([output])

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:  # a bad request fails alone; the loop lives on
            self._deliver(command.request_id, exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._deliver(output.request_id, output)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)

    def _notify(self, stats: StepStats) -> None:
        for fn in self._listeners:
            try:
                fn(stats)
            except Exception:  # noqa: BLE001 - a metrics bug must not kill the engine
                log.exception("step listener failed")
