"""Load generation: speculative and plain runs of the same prompts, interleaved round by round.

A round is one batch of requests at the load level (c prompts started together for a closed-loop
concurrency c; the whole prompt set on one seeded Poisson schedule for a request rate). Each round
runs once per mode, back to back, and the mode that goes first alternates, so drift in machine speed
falls on both modes alike.

Before a category is measured, each of its prompts is sent once (plain, one output token: `prime`),
so every measured request of either mode finds its prompt in the target's prefix cache. Without
that, whichever mode happened to see a prompt first paid its whole prefill (seconds on a CPU) and
the other got it free, which swamped the comparison with four prompts a cell. The draft model's
K/V are not primed: a speculative request that wants the draft pays its catch-up, as on a shared
prefix in service.

A peer (llama.cpp on the same GGUF file, llamacpp.py) joins the rounds at concurrency 1 as a third
mode: the three take turns on each prompt, the one that goes first rotating, so noise falls on all
alike. The peer is not primed: its server keeps only the last prompt's K/V.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from bench.serving.client import RequestResult, RequestSettings, send_request
from bench.serving.datasets import Prompt
from bench.serving.server_metrics import SpecCounters, scrape

MODES = ("spec", "plain")


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # closed loop: this many requests in flight
    request_rate: float | None = None  # open loop: Poisson arrivals per second

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("a load is either a concurrency or a request rate")

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.concurrency else f"rate={self.request_rate:g}"


@dataclass
class ModeRun:
    """One mode's measured rounds for one (category, load, repeat)."""

    mode: str
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0  # summed duration of its rounds
    counters: SpecCounters | None = None  # /metrics delta over its rounds


@dataclass
class Measurement:
    category: str
    load: Load
    repeat: int
    runs: dict[str, ModeRun]


@dataclass(frozen=True)
class Round:
    prompts: list[Prompt]
    offsets_s: list[float] | None  # arrival times after the round's start (request rate only)


def rounds_for(prompts: list[Prompt], load: Load, seed: int) -> list[Round]:
    if load.concurrency:
        c = load.concurrency
        total = -(-max(len(prompts), c) // c) * c  # whole rounds, prompts cycled to fill them
        batch = [prompts[i % len(prompts)] for i in range(total)]
        return [Round(batch[i : i + c], None) for i in range(0, total, c)]
    assert load.request_rate is not None
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in prompts:
        offsets.append(t)
        t += rng.expovariate(load.request_rate)
    return [Round(list(prompts), offsets)]


@dataclass(frozen=True)
class PeerTarget:
    """Another server measured in the same rounds as the two modes, at concurrency 1 only."""

    name: str
    send: Callable[[Prompt, RequestSettings], Awaitable[RequestResult]]


def modes_for(load: Load, peer: str | None = None) -> tuple[str, ...]:
    return (*MODES, peer) if peer and load.concurrency == 1 else MODES


def mode_order(round_index: int, repeat: int, modes: tuple[str, ...] = MODES) -> tuple[str, ...]:
    """The modes rotated by one each round and each repeat: every mode goes first as often."""
    shift = (round_index + repeat) % len(modes)
    return modes[shift:] + modes[:shift]


class Runner:
    def __init__(
        self,
        client: httpx.AsyncClient,
        settings: RequestSettings,
        max_concurrency: int | None = None,
        progress: tqdm | None = None,
        control: bool = False,  # A/A: the spec mode's requests are sent plain too
        peer: PeerTarget | None = None,
    ) -> None:
        self.client = client
        self.peer = peer
        self.control = control
        self.settings = settings
        self.max_concurrency = max_concurrency
        self.progress = progress

    async def measure(
        self, category: str, prompts: list[Prompt], load: Load, repeat: int, seed: int
    ) -> Measurement:
        modes = modes_for(load, self.peer.name if self.peer else None)
        runs = {mode: ModeRun(mode) for mode in modes}
        for index, rnd in enumerate(rounds_for(prompts, load, seed + repeat)):
            for mode in mode_order(index, repeat, modes):
                await self._run_round(rnd, runs[mode])
        return Measurement(category, load, repeat, runs)

    async def _run_round(self, rnd: Round, run: ModeRun) -> None:
        before = await self._scrape(run.mode)
        start = time.perf_counter()
        if rnd.offsets_s is None:
            tasks = [self._send(p, run.mode) for p in rnd.prompts]
        else:
            limit = asyncio.Semaphore(self.max_concurrency or len(rnd.prompts))
            tasks = [
                self._arrive(p, run.mode, start + o, limit)
                for p, o in zip(rnd.prompts, rnd.offsets_s, strict=True)
            ]
        run.results.extend(await asyncio.gather(*tasks))
        run.wall_s += time.perf_counter() - start
        after = await self._scrape(run.mode)
        if before is not None and after is not None:
            delta = after - before
            run.counters = delta if run.counters is None else run.counters + delta

    async def _scrape(self, mode: str) -> SpecCounters | None:
        return await scrape(self.client) if mode in MODES else None

    async def _arrive(
        self, prompt: Prompt, mode: str, at: float, limit: asyncio.Semaphore
    ) -> RequestResult:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        async with limit:
            return await self._send(prompt, mode)

    async def _send(self, prompt: Prompt, mode: str) -> RequestResult:
        if self.peer is not None and mode == self.peer.name:
            result = await self.peer.send(prompt, self.settings)
        else:
            spec = mode == "spec" and not self.control
            result = await send_request(self.client, prompt, self.settings, spec)
        if self.progress is not None:
            self.progress.update(1)
            if result.error:
                self.progress.write(
                    f"bench: {prompt.prompt_id} ({result.mode}) failed: {result.error}"
                )
        return result

    async def prime(self, prompts: list[Prompt]) -> None:
        """Put each prompt in the target's prefix cache, so neither mode measures its prefill."""
        once = RequestSettings(self.settings.model, 1, self.settings.temperature, False, 1800.0)
        for prompt in {p.prompt_id: p for p in prompts}.values():
            result = await send_request(self.client, prompt, once, False)
            if result.error:
                raise RuntimeError(f"priming {prompt.prompt_id} failed: {result.error}")

    async def warmup(self, prompt: Prompt) -> None:
        """One short request per mode, so that the first measured one pays no one-off costs."""
        short = RequestSettings(self.settings.model, 4, self.settings.temperature, False, 600.0)
        for spec in (True, False):
            result = await send_request(self.client, prompt, short, spec)
            if result.error:
                raise RuntimeError(f"warm-up request failed: {result.error}")
        if self.peer is not None:
            result = await self.peer.send(prompt, short)
            if result.error:
                raise RuntimeError(f"{self.peer.name}'s warm-up request failed: {result.error}")


def requests_per_measurement(prompts: list[Prompt], load: Load, peer: str | None = None) -> int:
    modes = modes_for(load, peer)
    return len(modes) * sum(len(r.prompts) for r in rounds_for(prompts, load, seed=0))
