"""OpenAI wire format: pydantic models of requests, responses and stream chunks.

Requests validate strictly (a string is not a number) and ignore the OpenAI fields we do not use;
each response also carries `spec_decode`, the speculative summary, which SDKs ignore.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.sample.sampling_params import SamplingParams
from engine.sample.structured import MAX_BIAS, Constraints

NonNegInt = Annotated[int, Field(ge=0)]
# vLLM's extra fields naming a grammar, and the kind engine.sample.structured compiles them as
GRAMMAR_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]
MAX_LOGPROBS = 20
MAX_N = 64


def _none(value: Any) -> bool:
    """For fields OpenAI declares non-nullable: omitted rather than null."""
    return value is None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---------------------------------------------------------------------------- requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (
            self.json_schema is None or self.json_schema.schema_ is None
        ):
            raise ValueError("json_schema.schema is required when type is json_schema")
        return self


@dataclass(frozen=True)
class GrammarRequest:
    """A constraint as the client gave it: which field, which kind (engine.sample.structured), what."""

    param: str
    kind: str  # json, regex, choice, grammar
    spec: Any


class SamplingFields(BaseModel):
    """Fields that completions and chat share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    return_token_origins: bool = False  # each token's text and proposer, on choices and chunks
    num_speculative_tokens: Annotated[int, Field(ge=0, le=64)] | None = None
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids, not {key!r}")
        return value

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingFields:
        given = [f for f in GRAMMAR_FIELDS if getattr(self, f) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(given)}")
        return self

    def grammar_request(self) -> GrammarRequest | None:
        """The grammar the output must follow, if any."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return GrammarRequest("response_format", "json", {"type": "object"})
        if rf is not None and rf.json_schema is not None and rf.type == "json_schema":
            return GrammarRequest(
                "response_format.json_schema.schema", "json", rf.json_schema.schema_
            )
        for name, kind in GRAMMAR_FIELDS.items():
            if getattr(self, name) is not None:
                return GrammarRequest(name, kind, getattr(self, name))
        return None

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), bias) for key, bias in (self.logit_bias or {}).items())

    def to_sampling_params(
        self, max_tokens: int, index: int, constraints: Constraints | None
    ) -> SamplingParams:
        """The engine's parameters for choice `index`; ValueError for what the engine refuses."""
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            seed=self.seed,
            choice=index,
            stop=self.stop_list,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            num_speculative_tokens=self.num_speculative_tokens,
            token_origins=self.return_token_origins,
            constraints=constraints,
        )

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for the engine."""
        return None, None

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if value == "" or value == [] or (isinstance(value, list) and "" in value):
            raise ValueError("prompt must not be empty")
        return value

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo and self.logprobs is not None else None

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of must equal n (no server-side ranking)")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str  # a JSON object as text


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this answers

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (tool-call arguments as objects)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        return message

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


def _template_call(call: ToolCall) -> dict[str, Any]:
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def uses_tools(self) -> bool:
        """Tools are shown to the model and its output parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools or [])

    def forced_tools(self) -> list[FunctionDefinition]:
        """The functions a grammar must hold the output to: all (required) or one (named)."""
        tools = [t.function for t in self.tools or []]
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in tools if f.name == self.tool_choice.function.name]
        return tools if self.tool_choice == "required" else []

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice in (None, "none", "auto"):
            return choice
        tools: list[ChatTool] = info.data.get("tools") or []
        if not tools:
            raise ValueError("tool_choice required or naming a function needs tools")
        names = {t.function.name for t in tools}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names no given tool: {choice.function.name!r}")
        return choice

    @model_validator(mode="after")
    def _tools_or_format(self) -> ChatCompletionRequest:
        if self.forced_tools() and self.grammar_request() is not None:
            raise ValueError("tool_choice required or named excludes response_format and guided_*")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[NonNegInt]
