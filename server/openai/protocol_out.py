"""OpenAI wire format, outbound: response bodies, stream chunks and the model list.

Each response also carries `spec_decode`, the speculative summary, which SDKs ignore.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from server.openai.protocol import ToolCall, _none, now

# ---------------------------------------------------------------------------- responses


class SpecDecodeSummary(BaseModel):
    num_drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None


class TokenOrigin(BaseModel):
    """One output token's text and who proposed it: "draft", "ngram" or "grammar" for an accepted
    draft, "target" for the target's own token (`return_token_origins`)."""

    text: str
    origin: str


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    @property
    def end_offset(self) -> int:
        """Offsets sum the tokens' own texts (a partial UTF-8 token reads as U+FFFD)."""
        return self.text_offset[-1] + len(self.tokens[-1]) if self.tokens else 0


class _Choice(BaseModel):
    """What every choice carries besides its content (text, message or delta) and logprobs."""

    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    spec_decode: SpecDecodeSummary | None = None
    token_origins: list[TokenOrigin] | None = Field(default=None, exclude_if=_none)


class _Response(BaseModel):
    """The fields of every response and chunk, in OpenAI's order; subclasses narrow `object` and
    `choices` (a redefined field keeps its place)."""

    id: str
    object: str
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = Field(default=None, exclude_if=_none)  # a string or absent
    choices: list[Any]
    usage: UsageInfo | None = Field(default=None, exclude_if=_none)
    spec_decode: SpecDecodeSummary | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"  # type: ignore[assignment]
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Choice):
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"  # type: ignore[assignment]
    choices: list[ChatChoice]
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, exclude_if=_none)
    arguments: str | None = Field(default=None, exclude_if=_none)


class DeltaToolCall(BaseModel):
    """A streamed fragment of a tool call: OpenAI sends id, type and name only in the first."""

    index: int
    id: str | None = Field(default=None, exclude_if=_none)
    type: Literal["function"] | None = Field(default=None, exclude_if=_none)
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = Field(default=None, exclude_if=_none)
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_none)


class ChatChunkChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"  # type: ignore[assignment]
    choices: list[ChatChunkChoice]
    prompt_token_ids: list[int] | None = None


class ModelWeights(BaseModel):
    """What a model's weights run as, and the memory they take."""

    model: str
    quantization: str  # formats by share of bytes, e.g. "int4-g32 + int8"
    weight_bytes: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "specserve"
    root: str | None = None
    max_model_len: int | None = None
    quantization: str | None = None  # the target's, as in `weights`
    weights: list[ModelWeights] | None = None  # the target, then the draft model if any


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
