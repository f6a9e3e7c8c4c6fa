"""Raw HTTP against a live server (real engine): every error's status and OpenAI shape, auth,
the waiting-queue limit, and aborts when a client disconnects."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import RealServer, assert_error_shape, metric_value, real_server, wait_for

API_KEY = "sekret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RealServer]:
    with real_server(
        tiny_model_dir, api_key=API_KEY, max_model_len=MAX_MODEL_LEN, max_num_seqs=2,
        max_waiting_requests=2,
    ) as live:  # fmt: skip
        yield live


@pytest.fixture(scope="module")
def http(server: RealServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as client:
        yield client


def post_raw(http: httpx.Client, path: str, body: str | bytes) -> httpx.Response:
    return http.post(path, content=body, headers={"Content-Type": "application/json"})


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    return assert_error_shape(response.json(), status)


BAD_COMPLETIONS: list[tuple[Any, str | None]] = [
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": -0.1}, "temperature"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 1000}, "n"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": [1, 2]}, "stop"),
    ({"prompt": "x", "seed": "abc"}, "seed"),
    ({"prompt": "x", "seed": 2**80}, "seed"),
    ({"prompt": "x", "echo": "true"}, "echo"),
    ({"prompt": "x", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "suffix": "y"}, None),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": "x " * 60, "max_tokens": 200}, "max_tokens"),
    ({"prompt": "x " * 400, "max_tokens": 1}, "prompt"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "x", "n": 64, "best_of": 2}, None),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"²": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias.5"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"prompt": "x", "guided_regex": "(ab"}, "guided_regex"),
    ({"prompt": "x", "guided_regex": 5}, "guided_regex"),
    ({"prompt": "x", "guided_json": {"type": "wat"}}, "guided_json"),
    ({"prompt": "x", "guided_json": "{not json"}, "guided_json"),
    ({"prompt": "x", "guided_choice": []}, "guided_choice"),
    ({"prompt": "x", "guided_grammar": "start: ( "}, "guided_grammar"),
    ({"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, None),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format.json_schema.schema"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}}, "response_format.json_schema.schema"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=lambda v: json.dumps(v)[:40])
def test_invalid_completion_fields_are_400(
    http: httpx.Client, body: Any, param: str | None
) -> None:
    error = error_of(post_raw(http, "/v1/completions", json.dumps(body)), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error


BAD_CHATS: list[tuple[Any, str | None]] = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    ({"messages": MSG, "logprobs": 3}, "logprobs"),
    ({"messages": MSG, "top_logprobs": 2}, None),
    ({"messages": MSG, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"messages": MSG, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ({"messages": MSG, "n": -1}, "n"),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, "prompt"),
    ({"messages": MSG, "logit_bias": {"400": 5}}, "logit_bias"),
    ({"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a"}, None),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"messages": MSG, "tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"messages": MSG, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, None),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f"}}]}]}, "messages.0.tool_calls.0.function.arguments"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD_CHATS, ids=lambda v: json.dumps(v)[:40])
def test_invalid_chat_fields_are_400(http: httpx.Client, body: Any, param: str | None) -> None:
    error = error_of(post_raw(http, "/v1/chat/completions", json.dumps(body)), 400)
    if param is not None:
        assert error["param"] == param, error


DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE_INT = b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
MALFORMED = [b"{bad json", b"", b"[]", b"null", b"42", b'"text"', b"\xff\xfe", b'{"prompt": "x",}']


@pytest.mark.parametrize("raw", [*MALFORMED, DEEP, HUGE_INT], ids=lambda raw: repr(raw[:16]))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_bodies_are_400(http: httpx.Client, path: str, raw: bytes) -> None:
    error_of(post_raw(http, path, raw), 400)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty"])
def test_nan_and_infinity_are_400(http: httpx.Client, field: str) -> None:
    for value in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"prompt": "x", "{field}": {value}}}'
        assert error_of(post_raw(http, "/v1/completions", body), 400)["param"] == field


def test_json_is_read_whatever_the_content_type(http: httpx.Client) -> None:
    body = b'{"prompt": "x", "max_tokens": 2}'
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d, ...
        r = http.post("/v1/completions", content=body, headers={"Content-Type": content_type})
        assert r.status_code == 200, r.text


def test_context_window_message_names_the_numbers(http: httpx.Client) -> None:
    error = error_of(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 300}), 400)
    assert str(MAX_MODEL_LEN) in error["message"] and error["code"] == "context_length_exceeded"


def test_stream_requests_are_validated_before_streaming(http: httpx.Client) -> None:
    body = {"prompt": "x", "max_tokens": 1000, "stream": True}
    error_of(http.post("/v1/completions", json=body), 400)


def test_unknown_model_is_404(http: httpx.Client) -> None:
    for path, body in [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
        ("/v1/chat/completions", {"model": "gpt-4", "messages": MSG}),
    ]:
        error = error_of(http.post(path, json=body), 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_unknown_route_and_method(http: httpx.Client) -> None:
    error_of(http.get("/v1/nothing"), 404)
    error_of(http.get("/v1/completions"), 405)


def test_api_key(server: RealServer) -> None:
    with httpx.Client(base_url=server.url) as anon:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}]:
            r = anon.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert error_of(r, 401)["code"] == "invalid_api_key"
            error_of(anon.get("/v1/models", headers=headers), 401)
        error_of(anon.post("/v1/completions", content=b"{bad"), 401)
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
        r = anon.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=AUTH)
        assert r.status_code == 200


def test_odd_but_valid_values_never_hurt_the_engine(server: RealServer, http: httpx.Client) -> None:
    odd: list[dict[str, Any]] = [
        {"temperature": 1e-30},
        {"temperature": 2, "top_p": 1e-9},
        {"top_k": 10**9, "min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"logprobs": 20, "echo": True},
        {"stop_token_ids": [99999]},
        {"seed": -(2**63)},
        {"prompt": [0, 0, 0]},
        {"prompt": "\x00\ud7ff😀 <|im_end|><|endoftext|>"},
    ]
    for extra in odd:
        body = {"prompt": "Hello", "max_tokens": 4} | extra
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert server.engine.is_alive


def test_waiting_queue_full_is_429(server: RealServer, http: httpx.Client) -> None:
    """max_num_seqs=2, max_waiting_requests=2: two run, two wait, the fifth is refused."""
    server.throttle.delay_s = 0.02
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    results: list[int] = []

    def one() -> None:
        results.append(http.post("/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=one) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: server.engine.num_waiting >= 2, what="two waiting requests")
        error = error_of(http.post("/v1/completions", json=body), 429)
        assert error["type"] == "rate_limit_error"
    finally:
        server.throttle.delay_s = 0.0
        for t in threads:
            t.join(timeout=60)
    assert results == [200] * 4


def _kv_is_free(server: RealServer, http: httpx.Client) -> bool:
    text = http.get("/metrics").text
    running = metric_value(text, "specserve:num_requests_running", model_name="tiny")
    usage = metric_value(text, "specserve:kv_cache_usage_perc", model_name="tiny")
    return (
        server.engine.num_running == 0
        and server.engine.kv_cache_usage == 0
        and usage == 0 == running
    )


def _aborted(http: httpx.Client) -> float:
    text = http.get("/metrics").text
    return metric_value(
        text, "specserve:request_success_total", model_name="tiny", finished_reason="abort"
    )


def test_disconnect_mid_stream_aborts(server: RealServer, http: httpx.Client) -> None:
    server.throttle.delay_s = 0.02  # ~50 steps/s: 240 tokens would take seconds
    aborted_before = _aborted(http)
    body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=server.url, headers=AUTH) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                data: list[str] = []
                for line in lines:
                    if line.startswith("data:"):
                        data.append(line)
                    if len(data) == 3:
                        break
                assert server.engine.num_running == 1 and server.engine.kv_cache_usage > 0
        wait_for(lambda: _kv_is_free(server, http), timeout_s=3, what="KV blocks freed")
        assert _aborted(http) == aborted_before + 1
    finally:
        server.throttle.delay_s = 0.0


def test_disconnect_while_waiting_for_a_full_response_aborts(
    server: RealServer, http: httpx.Client
) -> None:
    server.throttle.delay_s = 0.02
    aborted_before = _aborted(http)
    body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=body)
        wait_for(lambda: _kv_is_free(server, http), timeout_s=3, what="KV blocks freed")
        assert _aborted(http) == aborted_before + 1
    finally:
        server.throttle.delay_s = 0.0


LONE = "\\udcff"  # a JSON escape of a lone low surrogate: valid JSON, not valid Unicode
SURROGATE_BODIES: list[tuple[str, str, str]] = [
    ("/v1/completions", f'{{"prompt": "a{LONE}b"}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "{LONE}"]}}', "prompt.1"),
    ("/v1/completions", f'{{"prompt": "x", "stop": ["{LONE}"]}}', "stop.0"),
    ("/v1/completions", f'{{"prompt": "x", "model": "{LONE}"}}', "model"),
    ("/v1/completions", '{"prompt": "x", "user": "\\ud800"}', "user"),
    ("/v1/completions", f'{{"prompt": "x", "{LONE}": 1}}', None),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages.0.content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{LONE}"}}]}}]}}', "messages.0.content.0.text"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "name": "{LONE}", "content": "x"}}]}}', "messages.0.name"),
    ("/tokenize", f'{{"prompt": "{LONE}"}}', "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_BODIES, ids=lambda v: str(v)[:50])
def test_lone_surrogates_are_400(
    server: RealServer, http: httpx.Client, path: str, body: str, param: str | None
) -> None:
    for stream in (False, True):
        raw = body if path == "/tokenize" or not stream else body[:-1] + ', "stream": true}'
        error = error_of(post_raw(http, path, raw), 400)
        assert error["param"] == param, error
    assert server.engine.is_alive


INVALID_UTF8 = [
    b'{"prompt": "\xff"}',
    b'{"prompt": "ab\xc3"}',
    b'{"prompt": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8 bytes
    b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}',
    b'{"prompt": "x", "stop": ["\xfe"]}',
]


@pytest.mark.parametrize("raw", INVALID_UTF8, ids=repr)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_invalid_utf8_is_400(http: httpx.Client, path: str, raw: bytes) -> None:
    error = error_of(post_raw(http, path, raw), 400)
    assert "UTF-8" in error["message"] or "utf-8" in error["message"], error


def test_invalid_requests_are_400_even_when_the_queue_is_full(
    server: RealServer, http: httpx.Client
) -> None:
    """Validation comes before admission: a bad request is a 400, not a 429."""
    server.throttle.delay_s = 0.02
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    threads = [threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": body}) for _ in range(4)]  # fmt: skip
    try:
        for t in threads:
            t.start()
        wait_for(lambda: server.engine.num_waiting >= 2, what="two waiting requests")
        for path, bad in [
            ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}),
            ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 10_000}),
            ("/v1/completions", {"prompt": [1, 99999]}),
        ]:
            for stream in (False, True):
                error_of(http.post(path, json=bad | {"stream": stream}), 400)
        error_of(http.post("/v1/completions", json=body), 429)
    finally:
        server.throttle.delay_s = 0.0
        for t in threads:
            t.join(timeout=60)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value, odd strings included (lone surrogates, NULs, huge numbers)."""
    kind = rng.randrange(9 if depth < 3 else 6)
    strings = [
        "",
        "x",
        "\udcff",
        "\x00",
        "a" * 300,
        "(",
        "{",
        "12",
        "-1",
        "get_weather",
        "json_schema",
    ]
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 5, 101, 2**70, 399, 400])
    if kind == 3:
        return rng.choice([0.5, -100.0, 1e308, 3.0])
    if kind in (4, 5):
        return rng.choice(strings)
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["type", "json_schema", "schema", "name", "function", "parameters", "properties", "5", "\udcff"]  # fmt: skip
    return {rng.choice(keys): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


FUZZED_FIELDS = [
    "response_format", "tools", "tool_choice", "logit_bias", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "parallel_tool_calls", "messages", "prompt", "stop",
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_never_5xx(server: RealServer, http: httpx.Client, path: str) -> None:
    rng = random.Random(7)
    base: dict[str, Any] = {"max_tokens": 2}
    base |= {"prompt": "hi"} if path == "/v1/completions" else {"messages": MSG}
    statuses = []
    for _ in range(150):
        body = dict(base, stream=rng.random() < 0.3)
        for field in rng.sample(FUZZED_FIELDS, rng.randint(1, 3)):
            body[field] = _random_value(rng)
        raw = json.dumps(body)  # lone surrogates go out as \\udcff escapes
        r = post_raw(http, path, raw)
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            error_of(r, r.status_code)
        elif body["stream"]:
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        statuses.append(r.status_code)
    assert 400 in statuses and 200 in statuses and server.engine.is_alive
