"""Reading a request body: strict UTF-8 JSON whose strings are all valid Unicode.

Python's json module accepts escapes of lone surrogates (`"\\udcff"`), which no tokenizer, regex
engine or response encoder can handle later; they are refused here, naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from server.errors import APIError, bad_request


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
