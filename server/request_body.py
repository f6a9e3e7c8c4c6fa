"""Reading a request body: strict UTF-8 JSON whose strings are all valid Unicode, validated
into a pydantic model; a bad body is a 400 naming the field.

Python's json module accepts escapes of lone surrogates (`"\\udcff"`), which no tokenizer, regex
engine or response encoder can handle later; they are refused here, naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, TypeAdapter, ValidationError

from server.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)
UNION_TAG = re.compile(r"str|int|float|bool|none|[\w-]+\[.*\]")


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400: malformed JSON, invalid UTF-8 or a lone surrogate."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the body is not valid UTF-8: {exc}") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"malformed JSON body: {exc}") from None
    check_unicode(data)
    return data


def check_unicode(data: Any) -> None:
    """Raise a 400 naming the first string (or key) that holds a lone surrogate."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                raise _surrogate_error(path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if _has_surrogate(key):
                    raise _surrogate_error(path)
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, str(i))) for i, item in enumerate(value))


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _surrogate_error(path: tuple[str, ...]) -> APIError:
    param = ".".join(path) or None
    where = f"{param}: " if param else ""
    return bad_request(f"{where}a string holds a lone UTF-16 surrogate escape", param)


def json_body(model: type[M]) -> Callable[[Request], Awaitable[M]]:
    """Parse the body as JSON whatever the Content-Type says (`curl -d` sends a form type)."""

    async def parse(request: Request) -> M:
        data = parse_json(await request.body())
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    return parse


def validate_each(adapter: TypeAdapter[Any], values: list[Any]) -> list[Any]:
    """Validate list items one by one, so an error names the item and its deepest field (a
    union's first member's complaint, "should be a valid string", helps no one)."""
    return [_validate_item(adapter, i, value) for i, value in enumerate(values)]


def _validate_item(adapter: TypeAdapter[Any], index: int, value: Any) -> Any:
    try:
        return adapter.validate_python(value, strict=True)
    except ValidationError as exc:
        err = max(exc.errors(), key=lambda e: len(e["loc"]))
        path = [str(p) for p in err["loc"][1:] if not UNION_TAG.fullmatch(str(p))]
        raise ValueError(f"{'.'.join([str(index), *path])}: {err['msg']}") from None


def validation_error(errors: Any) -> APIError:
    """The first pydantic error as a 400, with `param` the field's dotted path."""
    err: dict[str, Any] = next(iter(errors), {"loc": (), "msg": "invalid request", "type": ""})
    param = _param_of(err.get("loc", ()))
    if err.get("type") == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"malformed JSON body: {detail}".strip())
    if param is None and err.get("type") in ("missing", "model_type", "model_attributes_type"):
        return bad_request("the request body must be a JSON object")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"{param}: {msg}" if param else msg, param, "invalid_value")


def _param_of(loc: Any) -> str | None:
    """`('body', 'prompt', 'list[int]', 1)` -> `prompt`: union-member tags and after are noise."""
    parts: list[str] = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and UNION_TAG.fullmatch(part):
            break
        parts.append(str(part))
    return ".".join(parts) or None
