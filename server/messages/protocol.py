"""Anthropic Messages wire format (`/v1/messages`): the request with its content blocks, the
message it answers with, and the conversion to chat (`to_chat_request`), so sampling, stop
strings, grammar and tool parsing are chat's."""

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

from server.openai.protocol import ChatCompletionRequest, random_id
from server.openai.protocol_out import SpecDecodeSummary
from server.request_body import validate_each

_STRICT = ConfigDict(strict=True, extra="ignore")


def message_id() -> str:
    return f"msg_{random_id('x')[2:]}"


# ---------------------------------------------------------------------------- content blocks


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


def _block_tag(value: Any) -> str | None:
    tag = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return tag if isinstance(tag, str) else None


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(
        _block_tag,
        custom_error_type="invalid_block",
        custom_error_message="unknown or unsupported content block type "
        "(text, tool_use and tool_result are served)",
    ),
]


_BLOCK = TypeAdapter(Block)


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _blocks_one_by_one(cls, value: Any) -> Any:
        """An error names the block and its field."""
        return validate_each(_BLOCK, value) if isinstance(value, list) else value

    @property
    def blocks(self) -> list[Any]:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


# ---------------------------------------------------------------------------- tools and format


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _STRICT
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = _STRICT
    user_id: str | None = None


# ---------------------------------------------------------------------------- the request


class MessagesRequest(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)]
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    stream: bool = False
    ignore_eos: bool = False  # ours (as in chat), through the SDK's extra_body

    @model_validator(mode="after")
    def _consistent(self) -> MessagesRequest:
        names = {t.name for t in self.custom_tools}
        choice = self.tool_choice
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names no given tool: {choice.name!r}")
        if choice is not None and choice.type == "any" and not names:
            raise ValueError("tool_choice any needs tools")
        return self

    @property
    def custom_tools(self) -> list[Tool]:
        tools = []
        for i, tool in enumerate(self.tools or []):
            if tool.get("type", "custom") != "custom":
                raise ValueError(
                    f"tools.{i}: tool type {tool.get('type')!r} is not supported here; only "
                    "client tools with an input_schema (server tools run on Anthropic's servers)"
                )
            tools.append(Tool.model_validate(tool))
        return tools

    @model_validator(mode="after")
    def _tools_valid(self) -> MessagesRequest:
        self.custom_tools  # noqa: B018 - raises for a server tool or a malformed one
        return self

    def to_chat_request(self, stream: bool = False) -> ChatCompletionRequest:
        """The same request as chat; ValueError for a tool_result without its tool_use."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_completion_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences,
            "ignore_eos": self.ignore_eos,
            "user": self.metadata.user_id if self.metadata else None,
        }
        if self.custom_tools:
            body |= _chat_tools(self.custom_tools, self.tool_choice)
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        if self.output_config and self.output_config.format and not (self.tools and forced):
            schema = self.output_config.format.schema_
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        calls: set[str] = set()
        for i, message in enumerate(self.messages):
            if message.role == "assistant":
                messages.append(_assistant(message.blocks, calls))
            else:
                messages += _user(i, message.blocks, calls)
        return messages


def _chat_tools(tools: list[Tool], choice: ToolChoice | None) -> dict[str, Any]:
    functions = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
            },
        }
        for t in tools
    ]
    body: dict[str, Any] = {"tools": [_drop_none(f) for f in functions]}
    if choice is None:
        return body
    kind = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    body["tool_choice"] = kind or {"type": "function", "function": {"name": choice.name}}
    if choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    return body


def _drop_none(tool: dict[str, Any]) -> dict[str, Any]:
    tool["function"] = {k: v for k, v in tool["function"].items() if v is not None}
    return tool


def _assistant(blocks: list[Any], calls: set[str]) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    message: dict[str, Any] = {"role": "assistant", "content": text}
    uses = [b for b in blocks if isinstance(b, ToolUseBlock)]
    if uses:
        message["tool_calls"] = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)},
            }
            for b in uses
        ]
        calls.update(b.id for b in uses)
    if any(isinstance(b, ToolResultBlock) for b in blocks):
        raise ValueError("tool_result blocks belong in user messages")
    return message


def _user(index: int, blocks: list[Any], calls: set[str]) -> list[dict[str, Any]]:
    """Tool results become tool turns; text around them a user turn each."""
    messages: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if block.tool_use_id not in calls:
                raise ValueError(
                    f"messages.{index}: tool_result for unknown tool_use_id {block.tool_use_id!r}"
                )
            messages.append(
                {"role": "tool", "content": block.text, "tool_call_id": block.tool_use_id}
            )
        elif isinstance(block, ToolUseBlock):
            raise ValueError(f"messages.{index}: tool_use blocks belong in assistant messages")
        elif messages and messages[-1]["role"] == "user":
            messages[-1]["content"] += block.text
        else:
            messages.append({"role": "user", "content": block.text})
    return messages


class CountTokensRequest(MessagesRequest):
    max_tokens: Annotated[int, Field(ge=1)] = 1  # type: ignore[assignment]


# ---------------------------------------------------------------------------- the response


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    """Anthropic's usage; the fields it keeps for its own features are there, null."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: None = None
    inference_geo: None = None
    output_tokens_details: None = None
    server_tool_use: None = None
    service_tier: None = None


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    stop_details: None = None
    container: None = None
    usage: Usage
    spec_decode: SpecDecodeSummary | None = None
