"""The edges of /v1/responses and /v1/messages: the response store (kept across a restart,
bounded by retention and size, per API key), an engine that dies mid-stream, and a fuzz of
malformed bodies that must never get a 5xx. A fake engine keeps it fast: what is tested here is
the server's, not the engine's."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import FakeEngine, LiveServer

from server.app import create_app
from server.responses.store import ResponseStore, StoredResponse, owner_of
from server.settings import Settings


def stored(n: int) -> StoredResponse:
    return StoredResponse({"id": f"resp_{n}", "output": []}, [{"id": f"msg_{n}"}], [])


def test_store_round_trip_owner_and_delete(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=10, retention_s=0)
    store.put("resp_1", "alice", stored(1))
    assert store.get("resp_1", "alice") == stored(1)
    assert store.get("resp_1", "bob") is None, "another key's response reads as absent"
    assert not store.delete("resp_1", "bob")
    assert store.delete("resp_1", "alice") and store.get("resp_1", "alice") is None


def test_store_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.sqlite3"
    first = ResponseStore(path, max_responses=10, retention_s=0)
    first.put("resp_1", "", stored(1))
    first.close()
    assert ResponseStore(path, max_responses=10, retention_s=0).get("resp_1", "") == stored(1)


def test_store_evicts_the_oldest_beyond_its_size(tmp_path: Path) -> None:
    store = ResponseStore(":memory:", max_responses=3, retention_s=0)
    for n in range(5):
        store.put(f"resp_{n}", "", stored(n))
    assert len(store) == 3
    assert [store.get(f"resp_{n}", "") is not None for n in range(5)] == [False] * 2 + [True] * 3
    assert not list(tmp_path.iterdir()), "the memory store writes no file"


def test_store_forgets_after_retention(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("server.responses.store.time.time", lambda: clock[0])
    store = ResponseStore(":memory:", max_responses=10, retention_s=60)
    store.put("resp_old", "", stored(0))
    clock[0] += 30
    store.put("resp_new", "", stored(1))
    clock[0] += 31
    assert store.get("resp_old", "") is None and store.get("resp_new", "") is not None
    store.put("resp_later", "", stored(2))
    assert len(store) == 2, "expired responses are deleted at the next write"


def test_owner_is_a_hash_of_the_key() -> None:
    assert owner_of(None) == owner_of("") == ""
    assert owner_of("key-1") != owner_of("key-2") and "key" not in owner_of("key-1")


# ---------------------------------------------------------------------------- on a server


def serve(model_dir: Path, die_after_steps: int | None = None, **kw: Any) -> LiveServer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = FakeEngine(tokenizer, step_s=0.0, die_after_steps=die_after_steps)
    base: dict[str, Any] = dict(model=str(model_dir), served_model_name="tiny", kv_cache_gib=0.02)
    return LiveServer(create_app(engine, Settings(**(base | kw))))  # type: ignore[arg-type]


def test_restart_keeps_responses_per_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    body = {"model": "tiny", "input": "Hello", "max_output_tokens": 4}
    with serve(tiny_model_dir, response_store_path=path, api_key="a") as live:
        created = httpx.post(live.url + "/v1/responses", json=body, headers={"x-api-key": "a"})
        assert created.status_code == 200
    rid = created.json()["id"]
    with serve(tiny_model_dir, response_store_path=path, api_key="a") as live:
        again = httpx.get(f"{live.url}/v1/responses/{rid}", headers={"x-api-key": "a"})
        assert again.json() == created.json()
        follow = body | {"input": "More", "previous_response_id": rid}
        r = httpx.post(live.url + "/v1/responses", json=follow, headers={"x-api-key": "a"})
        assert r.status_code == 200 and r.json()["previous_response_id"] == rid
    with serve(tiny_model_dir, response_store_path=path, api_key="b") as live:
        other = httpx.get(f"{live.url}/v1/responses/{rid}", headers={"x-api-key": "b"})
        assert other.status_code == 404, "a response is visible only to the key that made it"


def test_engine_death_mid_stream_ends_each_stream_in_its_api(tiny_model_dir: Path) -> None:
    with serve(tiny_model_dir, die_after_steps=2, response_store="memory") as live:
        body = {"model": "tiny", "input": "Hello", "max_output_tokens": 40, "stream": True}
        with httpx.stream("POST", live.url + "/v1/responses", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        last = events[-1]
        assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
        assert "engine" in last["response"]["error"]["message"]
        stored = httpx.get(f"{live.url}/v1/responses/{last['response']['id']}").json()
        assert stored["status"] == "failed"
    with serve(tiny_model_dir, die_after_steps=2) as live:
        body = {
            "model": "tiny",
            "max_tokens": 40,
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        }
        with httpx.stream("POST", live.url + "/v1/messages", json=body) as r:
            lines = list(r.iter_lines())
        names = [line[7:] for line in lines if line.startswith("event: ")]
        assert names[:2] == ["message_start", "ping"] and names[-1] == "error"
        error = json.loads([line for line in lines if line.startswith("data: ")][-1][6:])
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"


# ---------------------------------------------------------------------------- fuzz

RESPONSES_SEEDS: list[dict[str, Any]] = [
    {"model": "tiny", "input": "Hello", "max_output_tokens": 4},
    {
        "model": "tiny",
        "instructions": "x",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        "max_output_tokens": 4,
        "metadata": {"k": "v"},
        "store": False,
    },
]
MESSAGES_SEEDS: list[dict[str, Any]] = [
    {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    {
        "model": "tiny",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "x"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f"},
        "stop_sequences": ["x"],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
    },
]
JUNK: list[Any] = [
    None, True, False, 0, -1, 2**70, 1.5, -1e308, "", "x", "\x00", "é" * 3000, [], [None], [[[]]],
    {}, {"type": None}, {"type": "x"}, {"type": "message"}, {"$ref": "#"}, {"type": "object", "properties": 1},
    [{"type": "function_call_output"}], [{"role": "tool"}], {"format": {"type": "regex"}},
]  # fmt: skip


def mutate(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """One random change somewhere inside value (a dict's key gone, added or changed, a list's
    item changed, dropped or repeated, or the value itself replaced by junk)."""
    if depth > 5 or rng.random() < 0.2 or not isinstance(value, dict | list) or not value:
        return rng.choice(JUNK)
    value = json.loads(json.dumps(value))
    if isinstance(value, dict):
        key = rng.choice(sorted(value))
        op = rng.random()
        if op < 0.2:
            del value[key]
        elif op < 0.3:
            value[rng.choice(["type", "role", "content", "input", "x"])] = rng.choice(JUNK)
        else:
            value[key] = mutate(rng, value[key], depth + 1)
        return value
    i = rng.randrange(len(value))
    op = rng.random()
    if op < 0.15:
        value.pop(i)
    elif op < 0.25:
        value.append(value[i])
    else:
        value[i] = mutate(rng, value[i], depth + 1)
    return value


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    with serve(tiny_model_dir, response_store="memory") as live:
        yield live


@pytest.mark.parametrize(
    ("path", "seeds", "anthropic"),
    [
        ("/v1/responses", RESPONSES_SEEDS, False),
        ("/v1/messages", MESSAGES_SEEDS, True),
        ("/v1/messages/count_tokens", MESSAGES_SEEDS, True),
    ],
)
def test_fuzzed_bodies_get_no_5xx(
    fuzz_server: LiveServer, path: str, seeds: list[dict[str, Any]], anthropic: bool
) -> None:
    rng = random.Random(path)
    bodies = [mutate(rng, rng.choice(seeds)) for _ in range(300)]
    statuses = set()
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        for body in bodies:
            r = http.post(path, json=body)
            statuses.add(r.status_code)
            assert r.status_code < 500, (body, r.text)
            if r.status_code >= 400:
                error = r.json()
                assert error["type"] == "error" if anthropic else set(error) == {"error"}, error
        for raw in (b"{", b"\xff\xfe", b"[1]", b'"x"', b"null", b'{"a": "\\udcff"}'):
            r = http.post(path, content=raw)
            assert r.status_code == 400, r.text
    assert 400 in statuses and 200 in statuses, "the fuzz reaches both refusals and answers"


def test_fuzzed_ids_and_params_get_no_5xx(fuzz_server: LiveServer) -> None:
    with httpx.Client(base_url=fuzz_server.url, timeout=30) as http:
        for rid in ("x", "resp_" + "a" * 500, "%00", "..", "resp_ü"):
            for method, suffix in [
                ("GET", ""),
                ("DELETE", ""),
                ("GET", "/input_items"),
                ("POST", "/cancel"),
            ]:
                r = http.request(method, f"/v1/responses/{rid}{suffix}")
                assert r.status_code == 404, r.text
        r = http.post("/v1/responses", json=RESPONSES_SEEDS[0])
        rid = r.json()["id"]
        for query in ("limit=0", "limit=x", "order=up", "after=nope", "limit=101"):
            r = http.get(f"/v1/responses/{rid}/input_items?{query}")
            assert r.status_code == 400, (query, r.text)
