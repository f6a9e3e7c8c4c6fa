"""OpenAI Responses wire format (`/v1/responses`): the request, its input items, the response
object and the typed stream events.

A request becomes a chat conversation (`to_chat_messages`) and a `ChatCompletionRequest`
(`to_chat_request`), so sampling, grammar and tool parsing are chat's; only the shapes differ.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from server.openai.protocol import ChatCompletionRequest, _none, random_id
from server.openai.protocol_out import SpecDecodeSummary
from server.request_body import validate_each

_STRICT = ConfigDict(strict=True, extra="ignore")
MAX_METADATA = 16


def item_id(prefix: str) -> str:
    return f"{prefix}_{random_id('x')[2:]}"


# ---------------------------------------------------------------------------- input items


class InputText(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    """A message: `{"role", "content"}` (EasyInputMessage) or with `type: message`."""

    model_config = _STRICT
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        tag = value.get("type", "message")
        return tag if isinstance(tag, str) else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message="unknown or unsupported input item type "
        "(message, function_call and function_call_output are served)",
    ),
]


_ITEM = TypeAdapter(InputItem)


# ---------------------------------------------------------------------------- tools and formats


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("schema is required when type is json_schema")
        return self


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormat | None = None


# ---------------------------------------------------------------------------- the request


class ResponsesRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    # ours (vLLM's extras), through the SDK's extra_body
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    ignore_eos: bool = False
    num_speculative_tokens: Annotated[int, Field(ge=0, le=64)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        """A string, or items each checked alone, so an error names the item and its field."""
        if isinstance(value, str) and value:
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("must be a non-empty string or a non-empty list of items")
        return validate_each(_ITEM, value)

    @field_validator("tools")
    @classmethod
    def _function_tools_only(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        for i, tool in enumerate(tools or []):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(
                    f"tools.{i}: tool type {kind!r} is not supported here; only function tools "
                    "(built-in tools such as web_search run on OpenAI's servers, not this one)"
                )
            FunctionTool.model_validate(tool)
        return tools or []

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA:
            raise ValueError(f"at most {MAX_METADATA} metadata keys")
        if any(len(key) > 64 for key in value or {}):
            raise ValueError("metadata keys are at most 64 characters")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        names = {t.name for t in self.function_tools}
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names no given tool: {choice.name!r}")
        if choice == "required" and not names:
            raise ValueError("tool_choice required needs tools")
        if self.background and not self.store:
            raise ValueError("background requires store to be true")
        if self.background and self.stream:
            raise ValueError("background with stream is not supported; poll GET instead")
        return self

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or []]

    @property
    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def to_chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The same request as chat: messages (from `to_chat_messages`), tools, format, sampling."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "num_speculative_tokens": self.num_speculative_tokens,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        tools = self.function_tools
        if tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in tools
            ]
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        fmt = self.text.format if self.text is not None else None
        forced = tools and self.tool_choice not in (None, "auto", "none")
        if fmt is not None and not forced:  # a forced call is all the output: no text to format
            body["response_format"] = _chat_format(fmt)
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )


def _chat_tool_choice(choice: str | FunctionToolChoice | None) -> Any:
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _chat_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }


def to_chat_messages(
    instructions: str | None, items: list[dict[str, Any]], num_history: int = 0
) -> list[dict[str, Any]]:
    """Responses items (as stored dicts; the first `num_history` from earlier responses) as chat
    messages: consecutive function calls join the assistant turn before them; a
    function_call_output needs its call earlier in the list."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text_of(item["content"])})
        elif kind == "function_call":
            _add_call(messages, item)
            calls.add(item["call_id"])
        elif item["call_id"] not in calls:
            raise ValueError(
                f"input.{i - num_history}: no function_call with call_id {item['call_id']!r} before this "
                "function_call_output"
            )
        else:
            output = _text_of(item["output"])
            messages.append({"role": "tool", "content": output, "tool_call_id": item["call_id"]})
    return messages


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any]) -> None:
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


# ---------------------------------------------------------------------------- the response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = OutputMessage | OutputFunctionCall


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(BaseModel):
    code: str
    message: str


Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    background: bool = False
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = Field(default=None, exclude_if=_none)
    user: str | None = Field(default=None, exclude_if=_none)  # a string or absent
    metadata: dict[str, str] = Field(default_factory=dict)
    spec_decode: SpecDecodeSummary | None = None

    @classmethod
    def start(cls, req: ResponsesRequest, response_id: str, model: str, created: int) -> Any:
        """The response as `response.created` shows it: the request echoed, no output yet."""
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else None
        return cls(
            id=response_id,
            created_at=created,
            status="queued" if req.background else "in_progress",
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=model,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            store=req.store,
            background=req.background,
            temperature=1.0 if req.temperature is None else req.temperature,
            text=text or {"format": {"type": "text"}},
            tool_choice=_echo_choice(req.tool_choice),
            tools=[t.model_dump() for t in req.function_tools],
            top_p=1.0 if req.top_p is None else req.top_p,
            user=req.user,
            metadata=req.metadata or {},
        )


def _echo_choice(choice: str | FunctionToolChoice | None) -> Any:
    if isinstance(choice, FunctionToolChoice):
        return choice.model_dump()
    return choice or "auto"


class ResponseItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def event_json(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=False)
