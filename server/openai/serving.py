"""Request plumbing every endpoint shares: admission, fan-out into engine jobs, merged output
streams, SSE, constraints and errors. `serving_completion` and `serving_chat` build on it.

A request with `n` choices (and possibly several prompts) fans out into one engine request per
choice; their output streams are merged, and an unfinished one is aborted when the client leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel
from starlette.requests import Request

from engine.core.async_engine import EngineDeadError
from engine.outputs import ContextLengthError, RequestOutput, SpecStats, TokenLogprob, TokenSpan
from engine.sample import structured
from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import Constraints
from server.admission import Admission, AdmissionConfig
from server.errors import APIError, bad_request, not_ready
from server.metrics import Metrics
from server.openai.protocol import GrammarRequest, SamplingFields, now
from server.openai.protocol_out import SpecDecodeSummary, TokenOrigin, UsageInfo
from server.settings import Settings

if TYPE_CHECKING:
    from engine.core.async_engine import AsyncLLM

logger = logging.getLogger("specserve.server")
MAX_CHOICES = 256


@dataclass(frozen=True)
class Job:
    """One engine request: one choice of one prompt."""

    index: int  # choice index in the response: prompt_index * n + i
    n: int  # choices per prompt
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None  # the prompt as the client sent it, for echo
    params: SamplingParams


@dataclass(frozen=True)
class Stream:
    """An SSE body and the engine requests behind it (to abort when the client leaves)."""

    events: AsyncIterator[str | dict[str, str]]  # data lines, or typed events (`event:` + data)
    request_ids: list[str]


@dataclass
class Choice:
    """Everything the engine has produced so far for one job."""

    job: Job
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    spans: list[TokenSpan] = field(default_factory=list)  # where the request asked for origins
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    num_outputs: int = 0
    next_text_offset: int = 0  # streamed logprobs: where the next token's text_offset starts
    state: Any = None  # what an endpoint keeps per choice while streaming (a tool-call parser)

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        self.spans += out.new_token_spans or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason if out.finished else None
        self.stop_reason = out.stop_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.spec = out.spec
        self.num_outputs += 1


def job_sizes(jobs: list[Job]) -> list[tuple[str, int]]:
    """(request id, prompt tokens) of each job, what admission weighs."""
    return [(job.request_id, len(job.prompt_ids)) for job in jobs]


def spec_summary(spec: SpecStats) -> SpecDecodeSummary:
    return SpecDecodeSummary(
        num_drafts=spec.num_drafts,
        drafted_tokens=spec.num_draft_tokens,
        accepted_tokens=spec.num_accepted_tokens,
        acceptance_rate=spec.acceptance_rate,
        mean_acceptance_length=spec.mean_acceptance_length,
    )


def chunk_spec(req: SamplingFields, c: Choice, out: RequestOutput) -> SpecDecodeSummary | None:
    """A chunk's speculative summary: on the last chunk, or on every one (the running totals)
    where the request watches its tokens' origins."""
    return spec_summary(c.spec) if out.finished or req.return_token_origins else None


def token_origins(req: SamplingFields, spans: list[TokenSpan] | None) -> list[TokenOrigin] | None:
    if not req.return_token_origins:
        return None
    return [TokenOrigin(text=span.text, origin=span.origin) for span in spans or []]


def total_spec(choices: Iterable[Choice]) -> SpecDecodeSummary:
    total = SpecStats()
    for choice in choices:
        total.merge(choice.spec)
    return spec_summary(total)


def usage_of(choices: list[Choice]) -> UsageInfo:
    """Each prompt counts once however many choices it has."""
    firsts = [c for c in choices if c.job.index % c.job.n == 0]
    prompt = sum(c.num_prompt_tokens or len(c.job.prompt_ids) for c in firsts)
    cached = sum(c.num_cached_tokens for c in firsts)
    completion = sum(len(c.token_ids) for c in choices)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
    )


class OpenAIServing:
    """What every endpoint does with a request: check it, turn it into jobs, run them."""

    endpoint = "other"  # the `endpoint` label of specserve:api_requests_total

    def __init__(self, engine: AsyncLLM, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.model_name = settings.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = len(engine.tokenizer)
        # The app gives every endpoint the one it shares (`Endpoints.build`).
        self.admission = Admission(AdmissionConfig.from_settings(settings), metrics)

    # ------------------------------------------------------------------ admission

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.settings.model):
            raise APIError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )

    def check_capacity(self, jobs: list[Job]) -> None:
        """Called once a request is fully validated: a bad request is a 400, never a 429."""
        if not self.engine.is_alive:
            raise not_ready("the engine has stopped", self.admission.retry_after_unavailable())
        self.admission.admit(self.engine, job_sizes(jobs))

    def refuse_early(self, req: Any) -> None:
        """Before the request's expensive part (tokenizing, a chat template, a grammar): a 429
        when the queue could take no request at all and this one is surely valid."""
        self.admission.refuse_if_full(self.engine, lambda: self.surely_valid(req))

    def surely_valid(self, req: Any) -> bool:
        """Whether the full path would surely accept `req` (parsed and validated by pydantic);
        an endpoint that cannot tell cheaply says False and refuses after full validation."""
        return False

    # ------------------------------------------------------------------ requests -> jobs

    async def constraints(
        self, req: SamplingFields, grammar: GrammarRequest | None
    ) -> Constraints | None:
        """logit_bias and the grammar, checked (compiling runs in a thread, off the loop)."""
        bias = req.logit_bias_pairs
        if any(t >= self.vocab_size for t, _ in bias):
            raise bad_request(
                f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias"
            )
        if grammar is None and not bias:
            return None
        await asyncio.to_thread(structured.warm_up, self.tokenizer)  # once per model; then free
        if grammar is None:
            return Constraints(logit_bias=bias)
        try:
            text = structured.grammar_from(grammar.kind, grammar.spec)
            await asyncio.to_thread(structured.check_grammar, text, self.tokenizer)
        except ValueError as exc:
            raise bad_request(f"{grammar.param}: {exc}", grammar.param) from None
        return Constraints(grammar=text, logit_bias=bias)

    def jobs(
        self,
        req: SamplingFields,
        response_id: str,
        prompts: list[tuple[list[int], str | None]],
        max_tokens: int,
        max_tokens_param: str,
        constraints: Constraints | None,
    ) -> list[Job]:
        n = req.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        jobs = []
        for p, (ids, text) in enumerate(prompts):
            for i in range(n):
                params = self._sampling_params(req, max_tokens, i, constraints)
                self._validate(ids, params, max_tokens_param)
                index = p * n + i
                jobs.append(Job(index, n, f"{response_id}-{index}", ids, text, params))
        return jobs

    def _validate(
        self, prompt_ids: list[int], params: SamplingParams, max_tokens_param: str
    ) -> None:
        """The engine's own checks (length, token ids, KV capacity), as a 400 before anything
        starts."""
        try:
            self.engine.validate(prompt_ids, params)
        except ContextLengthError as exc:
            raise bad_request(
                f"This model's maximum context length is {exc.max_model_len} tokens. However, "
                f"you requested {exc.num_prompt + exc.max_tokens} tokens ({exc.num_prompt} in the "
                f"prompt, {exc.max_tokens} in the completion).",
                "prompt" if exc.num_prompt >= exc.max_model_len else max_tokens_param,
                "context_length_exceeded",
            ) from None
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None

    @staticmethod
    def _sampling_params(
        req: SamplingFields, max_tokens: int, i: int, constraints: Constraints | None
    ) -> SamplingParams:
        try:
            return req.to_sampling_params(max_tokens, i, constraints)
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    # ------------------------------------------------------------------ running jobs

    async def run(self, jobs: list[Job]) -> AsyncGenerator[tuple[Job, RequestOutput]]:
        """Merge the jobs' output streams; on any exit, abort the unfinished ones."""
        queue: asyncio.Queue[tuple[Job, RequestOutput | BaseException | None]] = asyncio.Queue()
        unfinished = {job.request_id for job in jobs}
        self.metrics.count_request(self.endpoint)
        self.admission.started(job_sizes(jobs))

        async def pump(job: Job) -> None:
            tracker = self.metrics.track()
            try:
                async for out in self.engine.generate(job.request_id, job.prompt_ids, job.params):
                    tracker.observe(out)
                    await queue.put((job, out))
                await queue.put((job, None))
            except Exception as exc:
                await queue.put((job, exc))

        tasks = [asyncio.create_task(pump(job)) for job in jobs]
        try:
            while unfinished:
                job, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None or item.finished:
                    unfinished.discard(job.request_id)
                if item is not None:
                    yield job, item
        finally:
            self.admission.finished([j.request_id for j in jobs], len(jobs) - len(unfinished))
            await self._cleanup(tasks, unfinished)

    async def _cleanup(self, tasks: list[asyncio.Task[None]], unfinished: set[str]) -> None:
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            for request_id in unfinished:
                await self.abort(request_id)
                self.metrics.count_aborted()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # the engine may already be gone; nothing left to free
            logger.debug("abort of %s failed", request_id, exc_info=True)

    async def collect(self, raw: Request, jobs: list[Job]) -> list[Choice]:
        """Run the jobs to the end (cancelled if the client leaves first)."""
        return await until_disconnected(raw, self._collect(jobs))  # type: ignore[no-any-return]

    async def _collect(self, jobs: list[Job]) -> list[Choice]:
        choices = {job.index: Choice(job) for job in jobs}
        async with aclosing(self.run(jobs)) as outputs:
            async for job, out in outputs:
                choices[job.index].add(out)
        return [choices[job.index] for job in jobs]

    # ------------------------------------------------------------------ streaming

    def stream(
        self,
        jobs: list[Job],
        req: SamplingFields,
        make_chunks: Callable[[Choice, RequestOutput], list[BaseModel]],
        usage_chunk: Callable[[BaseModel, list[Choice]], BaseModel],
    ) -> Stream:
        """Validation is done (errors raised before the stream starts); this is the SSE body."""

        async def events() -> AsyncIterator[str]:
            choices = {job.index: Choice(job) for job in jobs}
            last: BaseModel | None = None
            created = now()  # one timestamp for every chunk, as OpenAI does
            try:
                async with aclosing(self.run(jobs)) as outputs:
                    async for job, out in outputs:
                        choices[job.index].add(out)
                        for last in make_chunks(choices[job.index], out):
                            last.created = created  # type: ignore[attr-defined]
                            yield dump(last)
                if req.include_usage and last is not None:
                    yield dump(usage_chunk(last, list(choices.values())))
            except Exception as exc:
                yield dump(error_body(exc))
            yield "[DONE]"

        return Stream(events(), [job.request_id for job in jobs])

    # ------------------------------------------------------------------ token text

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def dump(model: Any) -> str:
    if isinstance(model, dict):
        return json.dumps(model, ensure_ascii=False)
    return str(model.model_dump_json())


def error_body(exc: BaseException) -> dict[str, Any]:
    """An exception as the OpenAI error object (mid-stream, or from a handler)."""
    return as_api_error(exc).body().model_dump()


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return not_ready("the engine has stopped")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    logger.error("request failed", exc_info=exc)
    return APIError(500, "internal server error", code="internal_error")


class ClientDisconnected(Exception):
    pass


async def until_disconnected(raw: Request, work: Any) -> Any:
    """Await `work`; if the client disconnects first, cancel it (its cleanup aborts the jobs)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
