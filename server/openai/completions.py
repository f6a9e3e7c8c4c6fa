"""/v1/completions: prompts (text or token ids, one or several) to text, whole or streamed."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from engine.outputs import RequestOutput, TokenLogprob
from server.errors import bad_request
from server.openai.protocol import CompletionRequest, random_id
from server.openai.protocol_out import CompletionChoice, CompletionLogprobs, CompletionResponse
from server.openai.serving import (
    MAX_CHOICES,
    Choice,
    Job,
    OpenAIServing,
    Stream,
    chunk_spec,
    spec_summary,
    token_origins,
    total_spec,
    usage_of,
)


class OpenAIServingCompletion(OpenAIServing):
    endpoint = "completions"

    async def create(self, req: CompletionRequest, raw: Request) -> CompletionResponse:
        response_id = random_id("cmpl")
        jobs = await self.completion_jobs(req, response_id)
        choices = await self.collect(raw, jobs)
        return CompletionResponse(
            id=response_id,
            model=self.model_name,
            choices=[self.completion_choice(req, c) for c in choices],
            usage=usage_of(choices),
            spec_decode=total_spec(choices),
        )

    async def create_stream(self, req: CompletionRequest) -> Stream:
        response_id = random_id("cmpl")
        jobs = await self.completion_jobs(req, response_id)
        return self.stream(
            jobs, req, lambda c, o: [self._chunk(response_id, req, c, o)], _usage_chunk
        )

    async def completion_jobs(self, req: CompletionRequest, response_id: str) -> list[Job]:
        prompts = self._prompts(req)
        tokenized = [(self._tokenize(p), p if isinstance(p, str) else None) for p in prompts]
        constraints = await self.constraints(req, req.grammar_request())
        jobs = self.jobs(
            req, response_id, tokenized, req.max_tokens or 16, "max_tokens", constraints
        )
        self.check_capacity(jobs)
        return jobs

    def surely_valid(self, req: CompletionRequest) -> bool:
        """No grammar or logit_bias to compile, token ids in the vocabulary, and each text prompt
        within the window at twice its UTF-8 length plus special tokens (byte-level and byte-
        fallback tokenizers give at most one token per byte): the checks of the full path at an
        upper bound of the prompt's length, without tokenizing."""
        prompts = self._prompts(req)
        if req.grammar_request() is not None or req.logit_bias or req.echo:
            return False
        if len(prompts) * (req.n or 1) > MAX_CHOICES:
            return False
        try:
            params = req.to_sampling_params(req.max_tokens or 16, 0, None)
            for prompt in prompts:
                if isinstance(prompt, list) and max(prompt) >= self.vocab_size:
                    return False
                bound = [0] * (2 * len(prompt.encode()) + 8) if isinstance(prompt, str) else prompt
                self.engine.validate(bound, params)
        except ValueError:
            return False
        return True

    @staticmethod
    def _prompts(req: CompletionRequest) -> list[str | list[int]]:
        if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)):
            return [req.prompt]  # type: ignore[list-item]
        return list(req.prompt)  # type: ignore[arg-type]

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        return list(ids)

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
            token_origins=token_origins(req, c.spans),
        )

    def _chunk(
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
            spec_decode=chunk_spec(req, c, out),
            token_origins=token_origins(req, out.new_token_spans),
        )
        return CompletionResponse(id=response_id, model=self.model_name, choices=[choice])

    # ------------------------------------------------------------------ echo and logprobs

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


def _usage_chunk(last: Any, choices: list[Choice]) -> CompletionResponse:
    update = {"choices": [], "usage": usage_of(choices), "spec_decode": total_spec(choices)}
    return last.model_copy(update=update)  # type: ignore[no-any-return]
