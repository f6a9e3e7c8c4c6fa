"""Server life: 503 while loading and after a load failure, an engine that dies mid-stream (the
fake engine: the real one cannot be made to), and `specserve serve` with SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import FakeEngine, LiveServer, assert_error_shape, free_port, wait_for

from server.app import create_app
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def settings_for(model_dir: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = dict(model=str(model_dir), served_model_name="tiny", dtype="float32")
    return Settings(**(base | {"kv_cache_gib": 0.02} | kw))


def test_health_is_503_while_loading_then_200(tiny_model_dir: Path) -> None:
    from engine.core.async_engine import AsyncLLM

    settings = settings_for(tiny_model_dir)
    release = threading.Event()

    def load() -> AsyncLLM:
        release.wait(timeout=60)
        return AsyncLLM.from_config(settings.engine_config(), "tiny")

    with (
        LiveServer(create_app(None, settings, load=load)) as live,
        httpx.Client(base_url=live.url) as http,
    ):
        health = http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert assert_error_shape(r.json(), 503)["code"] == "engine_not_ready"
        assert http.get("/v1/models").status_code == 503
        assert http.get("/metrics").status_code == 200
        release.set()
        wait_for(lambda: http.get("/health").status_code == 200, timeout_s=60, what="loaded")
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_load_failure_is_reported(tmp_path: Path) -> None:
    settings = Settings(model=str(tmp_path / "missing"))
    errors: list[BaseException] = []

    def load() -> Any:
        raise FileNotFoundError("no model at that path")

    app = create_app(None, settings, load=load, on_load_error=errors.append)
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as http:
        wait_for(lambda: bool(errors), what="the load error")
        assert http.get("/health").json() == {"status": "failed"}
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert "no model at that path" in assert_error_shape(r.json(), 503)["message"]
    assert isinstance(errors[0], FileNotFoundError)


@pytest.fixture
def dying_server(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    engine = FakeEngine(AutoTokenizer.from_pretrained(str(tiny_model_dir)), die_after_steps=2)
    with LiveServer(create_app(engine, settings_for(tiny_model_dir))) as live:  # type: ignore[arg-type]
        yield live, engine


def test_engine_death_mid_stream_is_an_error_event(dying_server: Any) -> None:
    live, engine = dying_server
    with httpx.Client(base_url=live.url) as http:
        body = {"prompt": "hi", "max_tokens": 20, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert [c["choices"][0]["text"] != "" for c in chunks[:-1]] == [True, True]
        error = assert_error_shape(chunks[-1], 503)
        assert error["type"] == "service_unavailable"
        assert http.get("/health").json() == {"status": "dead"}
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert_error_shape(r.json(), 503)
        assert r.status_code == 503


def test_shutting_down_refuses_new_requests(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    engine = FakeEngine(AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    app = create_app(engine, settings_for(tiny_model_dir))  # type: ignore[arg-type]
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as http:
        assert http.get("/health").status_code == 200
        app.state.server.shutting_down = True  # what the SIGTERM handler sets
        assert http.get("/health").json() == {"status": "shutting_down"}
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert (
            r.status_code == 503 and "shutting down" in assert_error_shape(r.json(), 503)["message"]
        )
    assert engine.stopped, "the app shuts its engine down"


def test_engine_death_during_a_full_response_is_503(dying_server: Any) -> None:
    live, _ = dying_server
    with httpx.Client(base_url=live.url) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503
        assert_error_shape(r.json(), 503)


def test_cli_rejects_a_bad_flag_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from specserve.cli import main

    assert main(["serve", "--model", "m", "--port", "eighty"]) == 2
    assert "port" in capsys.readouterr().err


def test_serve_sigterm_finishes_running_requests(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "specserve", "serve", "--model", str(tiny_model_dir),
        "--dtype", "float32", "--port", str(port), "--speculative-method", "ngram",
        "--kv-cache-gib", "0.02", "--shutdown-grace-s", "20", "--num-threads", "1",
    ]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        statuses = _health_until_ready(url, proc)
        assert statuses[-1] == 200 and 503 in statuses, "503 while loading, then 200"
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)
                assert _new_request_refused(url)
                rest = [line[5:].strip() for line in lines if line.startswith("data:")]
        chunks = [json.loads(first[5:])] + [json.loads(d) for d in rest[:-1]]
        assert rest[-1] == "[DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", "finished, not cut off"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log_text = log_path.read_text()
    expected_lines = (
        "loading target model",
        "out of garbage collection",
        f"ready on {url}",
        "signal",
    )
    for expected in expected_lines:
        assert expected in log_text, log_text[-3000:]


def _new_request_refused(url: str) -> bool:
    time.sleep(0.3)  # the signal is handled asynchronously
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
    except httpx.TransportError:
        return True  # uvicorn has closed its listening socket
    return r.status_code == 503


def _health_until_ready(url: str, proc: subprocess.Popen[bytes]) -> list[int]:
    statuses: list[int] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            statuses.append(httpx.get(url + "/health", timeout=2).status_code)
        except httpx.TransportError:
            pass
        if statuses and statuses[-1] == 200:
            return statuses
        time.sleep(0.05)
    raise AssertionError(f"server never became ready (exit {proc.poll()}, statuses {statuses})")
