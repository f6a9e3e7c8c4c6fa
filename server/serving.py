"""Turn OpenAI requests into engine requests, and engine outputs into responses and SSE chunks.

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
from starlette.requests import Request

from engine.outputs import RequestOutput, SpecStats, TokenLogprob
from engine.sampling_params import SamplingParams
from server.errors import APIError, bad_request, not_ready
from server.metrics import Metrics
from server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    SamplingFields,
    SpecDecodeSummary,
    TopLogprob,
    UsageInfo,
    now,
    random_id,
)
from server.settings import Settings

if TYPE_CHECKING:
    from engine.async_engine import AsyncLLM

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

    events: AsyncIterator[str]
    request_ids: list[str]


@dataclass
class Choice:
    """Everything the engine has produced so far for one job."""

    job: Job
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    num_outputs: int = 0
    next_text_offset: int = 0  # streamed logprobs: where the next token's text_offset starts

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or []
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finish_reason = out.finish_reason if out.finished else None
        self.stop_reason = out.stop_reason
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.spec = out.spec
        self.num_outputs += 1


def spec_summary(spec: SpecStats) -> SpecDecodeSummary:
    return SpecDecodeSummary(
        num_drafts=spec.num_drafts,
        drafted_tokens=spec.num_draft_tokens,
        accepted_tokens=spec.num_accepted_tokens,
        acceptance_rate=spec.acceptance_rate,
        mean_acceptance_length=spec.mean_acceptance_length,
    )


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
    """The routes' one collaborator: checks against the model, fan-out, formatting."""

    def __init__(self, engine: AsyncLLM, settings: Settings, metrics: Metrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.model_name = settings.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = len(engine.tokenizer)

    # ------------------------------------------------------------------ admission

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.settings.model):
            raise APIError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )

    def check_capacity(self) -> None:
        if not self.engine.is_alive:
            raise not_ready("the engine has stopped")
        if self.engine.num_waiting >= self.settings.max_waiting_requests:
            raise APIError(
                429,
                f"too many requests waiting ({self.engine.num_waiting}); retry later",
                code="rate_limit_exceeded",
            )

    # ------------------------------------------------------------------ requests -> jobs

    def tokenize_prompt(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request("prompt must not be empty", param)
        return ids

    def chat_prompt(self, req: ChatCompletionRequest | Any) -> str:
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt
                and not getattr(req, "continue_final_message", False),
                continue_final_message=getattr(req, "continue_final_message", False),
            )
        except Exception as exc:  # a template that rejects the conversation
            raise bad_request(f"chat template failed: {exc}", "messages") from None
        return str(text)

    def completion_jobs(self, req: CompletionRequest, response_id: str) -> list[Job]:
        prompts: list[str | list[int]]
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
            prompts = [req.prompt]  # type: ignore[list-item]
        else:
            prompts = list(req.prompt)  # type: ignore[arg-type]
        tokenized = [(self.tokenize_prompt(p), p if isinstance(p, str) else None) for p in prompts]
        return self._jobs(req, response_id, tokenized, req.max_tokens or 16, "max_tokens")

    def chat_jobs(self, req: ChatCompletionRequest, response_id: str) -> list[Job]:
        text = self.chat_prompt(req)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the conversation renders to an empty prompt", "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_new_tokens or max(1, self.max_model_len - len(ids))
        return self._jobs(req, response_id, [(ids, text)], max_tokens, param)

    def _jobs(
        self,
        req: SamplingFields,
        response_id: str,
        prompts: list[tuple[list[int], str | None]],
        max_tokens: int,
        max_tokens_param: str,
    ) -> list[Job]:
        n = req.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
        jobs = []
        for p, (ids, text) in enumerate(prompts):
            self._check_length(len(ids), max_tokens, max_tokens_param)
            for i in range(n):
                params = self.sampling_params(req, max_tokens, i)
                self._validate(ids, params)
                index = p * n + i
                jobs.append(Job(index, n, f"{response_id}-{index}", ids, text, params))
        return jobs

    def _check_length(self, num_prompt: int, max_tokens: int, param: str) -> None:
        if num_prompt + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} in the completion).",
                "prompt" if num_prompt >= self.max_model_len else param,
                "context_length_exceeded",
            )

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks (token ids, KV capacity), as a 400 before anything starts."""
        try:
            self.engine.validate(prompt_ids, params)
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None

    def sampling_params(self, req: SamplingFields, max_tokens: int, i: int) -> SamplingParams:
        logprobs, prompt_logprobs = _logprob_counts(req)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k or 0,
                top_p=1.0 if req.top_p is None else req.top_p,
                min_p=req.min_p or 0.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                seed=None if req.seed is None else req.seed + i,
                stop=req.stop_list,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                num_speculative_tokens=req.num_speculative_tokens,
            )
        except ValueError as exc:
            raise bad_request(str(exc)) from None

    # ------------------------------------------------------------------ running jobs

    async def run(self, jobs: list[Job]) -> AsyncGenerator[tuple[Job, RequestOutput]]:
        """Merge the jobs' output streams; on any exit, abort the unfinished ones."""
        queue: asyncio.Queue[tuple[Job, RequestOutput | BaseException | None]] = asyncio.Queue()
        unfinished = {job.request_id for job in jobs}

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

    async def collect(self, jobs: list[Job]) -> list[Choice]:
        choices = {job.index: Choice(job) for job in jobs}
        async with aclosing(self.run(jobs)) as outputs:
            async for job, out in outputs:
                choices[job.index].add(out)
        return [choices[job.index] for job in jobs]

    # ------------------------------------------------------------------ completions

    async def completion(self, req: CompletionRequest, raw: Request) -> CompletionResponse:
        response_id = random_id("cmpl")
        jobs = self.completion_jobs(req, response_id)
        self.check_capacity()  # after validation: a bad request is a 400, never a 429
        choices = await until_disconnected(raw, self.collect(jobs))
        return CompletionResponse(
            id=response_id,
            model=self.model_name,
            choices=[self.completion_choice(req, c) for c in choices],
            usage=usage_of(choices),
            spec_decode=total_spec(choices),
        )

    def completion_choice(self, req: CompletionRequest, c: Choice) -> CompletionChoice:
        prefix = self._echo_text(c.job) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            entries = self._prompt_entries(c) if req.echo else []
            entries += [(lp.token_id, lp) for lp in c.logprobs]
            logprobs = self.completion_logprobs(entries, 0)
        return CompletionChoice(
            index=c.job.index,
            text=prefix + c.text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_token_ids=c.job.prompt_ids if req.return_token_ids else None,
            token_ids=c.token_ids if req.return_token_ids else None,
            spec_decode=spec_summary(c.spec),
        )

    def stream_completion(self, req: CompletionRequest) -> Stream:
        response_id = random_id("cmpl")
        jobs = self.completion_jobs(req, response_id)
        self.check_capacity()  # after validation: a bad request is a 400, never a 429
        return self._stream(jobs, req, lambda c, o: self._completion_chunk(response_id, req, c, o))

    def _completion_chunk(
        self, response_id: str, req: CompletionRequest, c: Choice, out: RequestOutput
    ) -> CompletionResponse:
        first = c.num_outputs == 1
        prefix = self._echo_text(c.job) if req.echo and first else ""
        logprobs = None
        if req.logprobs is not None:
            entries = self._prompt_entries(c) if req.echo and first else []
            entries += [(lp.token_id, lp) for lp in out.new_logprobs or []]
            logprobs = self.completion_logprobs(entries, c.next_text_offset)
            c.next_text_offset = logprobs.end_offset or c.next_text_offset
        choice = CompletionChoice(
            index=c.job.index,
            text=prefix + out.new_text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if out.finished else None,
            prompt_token_ids=c.job.prompt_ids if req.return_token_ids and first else None,
            token_ids=out.new_token_ids if req.return_token_ids else None,
            spec_decode=spec_summary(c.spec) if out.finished else None,
        )
        return CompletionResponse(id=response_id, model=self.model_name, choices=[choice])

    # ------------------------------------------------------------------ chat

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> ChatCompletionResponse:
        response_id = random_id("chatcmpl")
        jobs = self.chat_jobs(req, response_id)
        self.check_capacity()  # after validation: a bad request is a 400, never a 429
        choices = await until_disconnected(raw, self.collect(jobs))
        return ChatCompletionResponse(
            id=response_id,
            model=self.model_name,
            choices=[self.chat_choice(req, c) for c in choices],
            usage=usage_of(choices),
            prompt_token_ids=jobs[0].prompt_ids if req.return_token_ids else None,
            spec_decode=total_spec(choices),
        )

    def chat_choice(self, req: ChatCompletionRequest, c: Choice) -> ChatChoice:
        return ChatChoice(
            index=c.job.index,
            message=ChatResponseMessage(content=c.text),
            logprobs=self.chat_logprobs(req, c.logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            prompt_token_ids=c.job.prompt_ids if req.return_token_ids else None,
            token_ids=c.token_ids if req.return_token_ids else None,
            spec_decode=spec_summary(c.spec),
        )

    def stream_chat(self, req: ChatCompletionRequest) -> Stream:
        response_id = random_id("chatcmpl")
        jobs = self.chat_jobs(req, response_id)
        self.check_capacity()  # after validation: a bad request is a 400, never a 429
        return self._stream(jobs, req, lambda c, o: self._chat_chunk(response_id, req, c, o))

    def _chat_chunk(
        self, response_id: str, req: ChatCompletionRequest, c: Choice, out: RequestOutput
    ) -> ChatCompletionChunk:
        first = c.num_outputs == 1
        choice = ChatChunkChoice(
            index=c.job.index,
            delta=DeltaMessage(role="assistant" if first else None, content=out.new_text),
            logprobs=self.chat_logprobs(req, out.new_logprobs or []),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if out.finished else None,
            prompt_token_ids=c.job.prompt_ids if req.return_token_ids and first else None,
            token_ids=out.new_token_ids if req.return_token_ids else None,
            spec_decode=spec_summary(c.spec) if out.finished else None,
        )
        prompt_ids = c.job.prompt_ids if req.return_token_ids and first else None
        return ChatCompletionChunk(
            id=response_id, model=self.model_name, choices=[choice], prompt_token_ids=prompt_ids
        )

    # ------------------------------------------------------------------ streaming

    def _stream(
        self,
        jobs: list[Job],
        req: SamplingFields,
        make_chunk: Callable[[Choice, RequestOutput], CompletionResponse | ChatCompletionChunk],
    ) -> Stream:
        """Validation is done (errors raised before the stream starts); this is the SSE body."""

        async def events() -> AsyncIterator[str]:
            choices = {job.index: Choice(job) for job in jobs}
            last: CompletionResponse | ChatCompletionChunk | None = None
            created = now()  # one timestamp for every chunk, as OpenAI does
            try:
                async with aclosing(self.run(jobs)) as outputs:
                    async for job, out in outputs:
                        choices[job.index].add(out)
                        last = make_chunk(choices[job.index], out)
                        last.created = created
                        yield dump(last)
                if req.include_usage and last is not None:
                    yield dump(self._usage_chunk(last, list(choices.values())))
            except Exception as exc:
                yield dump(error_body(exc))
            yield "[DONE]"

        return Stream(events(), [job.request_id for job in jobs])

    def _usage_chunk(
        self, last: CompletionResponse | ChatCompletionChunk, choices: list[Choice]
    ) -> CompletionResponse | ChatCompletionChunk:
        update: dict[str, Any] = {"choices": [], "usage": usage_of(choices)}
        update["spec_decode"] = total_spec(choices)
        if isinstance(last, ChatCompletionChunk):
            update["prompt_token_ids"] = None
        return last.model_copy(update=update)

    # ------------------------------------------------------------------ logprobs and text

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _echo_text(self, job: Job) -> str:
        if job.prompt_text is not None:
            return job.prompt_text
        return str(self.tokenizer.decode(job.prompt_ids))

    def _prompt_entries(self, c: Choice) -> list[tuple[int, TokenLogprob | None]]:
        lps = c.prompt_logprobs or [None] * len(c.job.prompt_ids)
        return list(zip(c.job.prompt_ids, lps, strict=False))

    def completion_logprobs(
        self, entries: list[tuple[int, TokenLogprob | None]], offset: int
    ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for token_id, lp in entries:
            text = self.token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if lp is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(lp.logprob)
            top = {self.token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            result.top_logprobs.append(top)
        return result

    def chat_logprobs(
        self, req: ChatCompletionRequest, logprobs: list[TokenLogprob]
    ) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        num_top = req.top_logprobs or 0
        content = [
            ChatTokenLogprob(
                **self._top_logprob(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[self._top_logprob(t, v) for t, v in lp.top[:num_top]],
            )
            for lp in logprobs
        ]
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


def _logprob_counts(req: SamplingFields) -> tuple[int | None, int | None]:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None, None
    if isinstance(req, CompletionRequest):
        return req.logprobs, req.logprobs if req.echo and req.logprobs is not None else None
    return None, None


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
    if type(exc).__name__ == "EngineDeadError":
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
