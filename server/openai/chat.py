"""/v1/chat/completions: a conversation through the chat template to an assistant message,
whole or streamed; with tools, the model's calls (in its family's format, tool_formats.py) become
`message.tool_calls`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from engine.outputs import RequestOutput, TokenLogprob
from server.errors import bad_request
from server.metrics import Metrics
from server.openai.protocol import (
    ChatCompletionRequest,
    GrammarRequest,
    TokenizeRequest,
    ToolCall,
    random_id,
)
from server.openai.protocol_out import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    TopLogprob,
)
from server.openai.serving import (
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
from server.openai.tool_formats import ToolFormat, marker_token_ids, tool_call_grammar, tool_format
from server.openai.tool_parser import ParsedDelta, ToolCallParser, parse_message
from server.settings import Settings

if TYPE_CHECKING:
    from engine.core.async_engine import AsyncLLM


class OpenAIServingChat(OpenAIServing):
    endpoint = "chat_completions"

    def __init__(self, engine: AsyncLLM, settings: Settings, metrics: Metrics) -> None:
        super().__init__(engine, settings, metrics)
        self.tool_format = tool_format(settings.tool_call_parser, self.tokenizer)
        self.tool_tokens = marker_token_ids(self.tool_format, self.tokenizer)

    async def create(self, req: ChatCompletionRequest, raw: Request) -> ChatCompletionResponse:
        response_id = random_id("chatcmpl")
        jobs = await self.chat_jobs(req, response_id)
        choices = await self.collect(raw, jobs)
        return ChatCompletionResponse(
            id=response_id,
            model=self.model_name,
            choices=[self.chat_choice(req, c) for c in choices],
            usage=usage_of(choices),
            prompt_token_ids=jobs[0].prompt_ids if req.return_token_ids else None,
            spec_decode=total_spec(choices),
        )

    async def create_stream(self, req: ChatCompletionRequest) -> Stream:
        response_id = random_id("chatcmpl")
        jobs = await self.chat_jobs(req, response_id)
        return self.stream(
            jobs, req, lambda c, o: [self._chunk(response_id, req, c, o)], _usage_chunk
        )

    # ------------------------------------------------------------------ prompt

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> str:
        messages = [m.template_dict() for m in req.messages or []]
        continue_final = getattr(req, "continue_final_message", False)
        tools: list[dict[str, Any] | Callable[..., Any]] | None = None  # the template's type
        if isinstance(req, ChatCompletionRequest) and req.uses_tools:
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt and not continue_final,
                continue_final_message=continue_final,
            )
        except Exception as exc:  # a template that rejects the conversation
            raise bad_request(f"chat template failed: {exc}", "messages") from None
        return str(text)

    async def chat_jobs(self, req: ChatCompletionRequest, response_id: str) -> list[Job]:
        text = self.chat_prompt(req)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("the conversation renders to an empty prompt", "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_new_tokens or max(1, self.max_model_len - len(ids))
        constraints = await self.constraints(req, self.grammar_request(req))
        jobs = self.jobs(req, response_id, [(ids, text)], max_tokens, param, constraints)
        if req.uses_tools and self.tool_tokens:
            kept = tuple(self.tool_tokens.values())
            jobs = [replace(j, params=replace(j.params, kept_special_ids=kept)) for j in jobs]
        self.check_capacity(jobs)
        return jobs

    def grammar_request(self, req: ChatCompletionRequest) -> GrammarRequest | None:
        """A forced tool call's grammar, in the model's format; else the request's own."""
        forced = req.forced_tools()
        if not forced:
            return req.grammar_request()
        functions = [f.model_dump(exclude_none=True) for f in forced]
        # Several calls only when asked for: the model rarely ends a run of calls by itself (its
        # turn end, <|im_end|>, is not the end of text a grammar may stop at).
        parallel = req.parallel_tool_calls is True
        grammar = tool_call_grammar(self.tool_format, functions, parallel, self.tool_tokens)
        return GrammarRequest("tool_choice", "lark", grammar)

    # ------------------------------------------------------------------ responses

    def chat_choice(self, req: ChatCompletionRequest, c: Choice) -> ChatChoice:
        message = ChatResponseMessage(content=c.text)
        finish_reason = c.finish_reason
        if req.uses_tools:
            parsed = parse_message(c.text, req.tool_names, self.tool_format)
            calls = [ToolCall.model_validate(call) for call in parsed.calls]
            message = ChatResponseMessage(content=parsed.content, tool_calls=calls)
            finish_reason = _finish_reason(finish_reason, bool(calls))
        return ChatChoice(
            index=c.job.index,
            message=message,
            logprobs=self.chat_logprobs(req, c.logprobs),
            finish_reason=finish_reason,
            stop_reason=c.stop_reason,
            prompt_token_ids=c.job.prompt_ids if req.return_token_ids else None,
            token_ids=c.token_ids if req.return_token_ids else None,
            spec_decode=spec_summary(c.spec),
            token_origins=token_origins(req, c.spans),
        )

    def _chunk(
        self, response_id: str, req: ChatCompletionRequest, c: Choice, out: RequestOutput
    ) -> ChatCompletionChunk:
        first = c.num_outputs == 1
        delta = DeltaMessage(role="assistant" if first else None, content=out.new_text)
        finish_reason = c.finish_reason
        if req.uses_tools:
            delta, has_calls = _tool_delta(c, out, req.tool_names, self.tool_format)
            delta.role = "assistant" if first else None
            finish_reason = _finish_reason(finish_reason, has_calls)
        choice = ChatChunkChoice(
            index=c.job.index,
            delta=delta,
            logprobs=self.chat_logprobs(req, out.new_logprobs or []),
            finish_reason=finish_reason,
            stop_reason=c.stop_reason if out.finished else None,
            prompt_token_ids=c.job.prompt_ids if req.return_token_ids and first else None,
            token_ids=out.new_token_ids if req.return_token_ids else None,
            spec_decode=chunk_spec(req, c, out),
            token_origins=token_origins(req, out.new_token_spans),
        )
        prompt_ids = c.job.prompt_ids if req.return_token_ids and first else None
        return ChatCompletionChunk(
            id=response_id, model=self.model_name, choices=[choice], prompt_token_ids=prompt_ids
        )

    # ------------------------------------------------------------------ logprobs

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


def _tool_delta(
    c: Choice, out: RequestOutput, tool_names: frozenset[str], fmt: ToolFormat
) -> tuple[DeltaMessage, bool]:
    parsed = parsed_delta(c, out, tool_names, fmt)
    calls = [
        DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function" if call.id is not None else None,
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
        for call in parsed.calls
    ]
    delta = DeltaMessage(content=parsed.content or None, tool_calls=calls or None)
    return delta, c.state.has_calls


def parsed_delta(
    c: Choice, out: RequestOutput, tool_names: frozenset[str], fmt: ToolFormat
) -> ParsedDelta:
    """This output's text through the choice's tool-call parser (one per choice, kept in
    `c.state`); every endpoint that parses tool calls streams through here."""
    if c.state is None:
        c.state = ToolCallParser(fmt, tool_names)
    parser: ToolCallParser = c.state
    parsed = parser.feed(out.new_text)
    if out.finished:
        rest = parser.finish()
        parsed = ParsedDelta(parsed.content + rest.content, parsed.calls + rest.calls)
    return parsed


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _usage_chunk(last: Any, choices: list[Choice]) -> ChatCompletionChunk:
    update = {
        "choices": [],
        "usage": usage_of(choices),
        "spec_decode": total_spec(choices),
        "prompt_token_ids": None,
    }
    return last.model_copy(update=update)  # type: ignore[no-any-return]


def output_delta(
    c: Choice, out: RequestOutput, req: ChatCompletionRequest, fmt: ToolFormat
) -> ParsedDelta:
    """A streamed output as content and tool-call fragments (content only without tools)."""
    if req.uses_tools:
        return parsed_delta(c, out, req.tool_names, fmt)
    return ParsedDelta(content=out.new_text)


def whole_output(text: str, req: ChatCompletionRequest, fmt: ToolFormat) -> ParsedDelta:
    """A finished output the same way, in one piece: what the stream's fragments add up to."""
    if not req.uses_tools:
        return ParsedDelta(content=text)
    parser = ToolCallParser(fmt, req.tool_names)
    first, rest = parser.feed(text), parser.finish()
    return ParsedDelta(first.content + rest.content, first.calls + rest.calls)
