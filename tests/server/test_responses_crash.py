"""What a crash leaves behind in the response store: `specserve serve` (a subprocess, tiny model)
killed with SIGKILL, or stopped by SIGTERM with a grace period too short for its streams, while
stored responses stream; then restarted on the same SQLite file. Every completed response reads
back intact, none stays `in_progress`, the cut ones are `failed` with their partial text, the file
passes `PRAGMA integrity_check`, new requests are served and a continuation of a failed response
is a 400."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import FakeEngine, LiveServer, assert_error_shape, free_port, wait_for
from tiny import make_tiny_model

from server.app import create_app
from server.responses.interrupted import CHECKPOINT_S, STOPPED, as_interrupted
from server.responses.store import ResponseStore, StoredResponse
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
LONG = 3000  # output tokens: tens of seconds on a busy 2-core host, seconds on a fast one
FINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for long answers (the default tiny one stops at 512 tokens)."""
    return make_tiny_model(tmp_path_factory.mktemp("crash_model"), max_position_embeddings=4096)


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path


@contextmanager
def serve(model: Path, store: Path, log: Path, grace_s: float = 5.0) -> Iterator[Server]:
    """`specserve serve` on the store file, ready (/health 200) within two minutes."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "specserve", "serve", "--model", str(model),
        "--served-model-name", "tiny", "--dtype", "float32", "--port", str(port),
        "--speculative-method", "ngram", "--kv-cache-gib", "0.03", "--num-threads", "1",
        "--response-store-path", str(store), "--shutdown-grace-s", str(grace_s),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_for(lambda: _ready(server), timeout_s=120, what=f"the server ({log})")
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _ready(server: Server) -> bool:
    if server.proc.poll() is not None:
        raise AssertionError(f"the server exited: {server.log.read_text()[-3000:]}")
    try:
        return httpx.get(server.url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class Reader(threading.Thread):
    """One streamed response, read to whatever end the server gives it."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.id: str | None = None
        self.text = ""
        self.final: dict[str, Any] | None = None
        self.flowing = threading.Event()  # some text has arrived (or the stream ended)

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/responses", json=self.body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self._take(json.loads(line[6:]))
        except httpx.HTTPError:
            pass  # the server went away mid-stream: what the test is about
        finally:
            self.flowing.set()

    def _take(self, event: dict[str, Any]) -> None:
        if event["type"] == "response.created":
            self.id = event["response"]["id"]
        elif event["type"] == "response.output_text.delta":
            self.text += event["delta"]
            if len(self.text) >= 8:
                self.flowing.set()
        elif event["type"] in FINAL:
            self.final = event["response"]


def ask(text: str, max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": text, "max_output_tokens": max_tokens, "temperature": 0} | kw


def store_some(http: httpx.Client, n: int) -> dict[str, dict[str, Any]]:
    """n short stored responses, each as it was returned."""
    done = {}
    for i in range(n):
        r = http.post("/v1/responses", json=ask(f"Say {i}", 6))
        assert r.status_code == 200 and r.json()["status"] in ("completed", "incomplete"), r.text
        done[r.json()["id"]] = r.json()
    return done


def start_streams(url: str, n: int) -> list[Reader]:
    """n long streamed responses, each surely generating (text arrived) and checkpointed."""
    readers = [Reader(url, ask(f"Count {i}", LONG, stream=True, ignore_eos=True)) for i in range(n)]
    for reader in readers:
        reader.start()
    for reader in readers:
        assert reader.flowing.wait(timeout=60), "a stream never started"
    time.sleep(3 * CHECKPOINT_S)  # every stream writes its output so far at least once
    assert all(r.final is None and r.id for r in readers), "a stream ended before the cut"
    return readers


def stored_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The store file as the next process finds it: each response by id."""
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        rows = db.execute("SELECT id, body FROM responses").fetchall()
    return {rid: json.loads(body)["response"] for rid, body in rows}


def text_of(response: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def assert_cut(response: dict[str, Any]) -> None:
    """A response the server could not finish, as GET shows it after the restart."""
    assert response["status"] == "failed", response
    assert response["error"] == {"code": "server_error", "message": STOPPED}
    assert response["completed_at"] is None
    assert all(item["status"] == "incomplete" for item in response["output"]), response["output"]


def assert_serving_after(http: httpx.Client, completed: dict[str, Any], failed_id: str) -> None:
    """New requests served; a continuation of a completed response runs, of a failed one is a
    400 naming it."""
    fresh = http.post("/v1/responses", json=ask("Hello again", 6))
    assert fresh.status_code == 200 and fresh.json()["status"] in ("completed", "incomplete")
    ok = http.post("/v1/responses", json=ask("More", 4, previous_response_id=completed["id"]))
    assert ok.status_code == 200 and ok.json()["previous_response_id"] == completed["id"]
    refused = http.post("/v1/responses", json=ask("More", 4, previous_response_id=failed_id))
    assert refused.status_code == 400
    error = assert_error_shape(refused.json(), 400)
    assert error["param"] == "previous_response_id" and error["code"] == "previous_response_failed"
    assert failed_id in error["message"] and "stopped" in error["message"]


# ---------------------------------------------------------------------------- in one process


def test_store_fails_what_is_unfinished_whoever_owns_it(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path / "r.sqlite3", max_responses=10, retention_s=0)
    item = {"type": "message", "status": "in_progress", "content": [{"text": "par"}]}
    running = {"id": "resp_run", "status": "in_progress", "output": [item]}
    done = {"id": "resp_done", "status": "completed", "output": []}
    store.put("resp_run", "alice", StoredResponse(running, [{"id": "msg_1"}], []))
    store.put("resp_wait", "", StoredResponse({"status": "queued", "output": []}, [], []))
    store.put("resp_done", "bob", StoredResponse(done, [], []))
    assert sorted(store.rewrite_unfinished(as_interrupted)) == ["resp_run", "resp_wait"]
    got = store.get("resp_run", "alice")
    assert got is not None and got.input_items == [{"id": "msg_1"}]
    assert got.response["status"] == "failed" and got.response["error"]["message"] == STOPPED
    assert got.response["output"] == [item | {"status": "incomplete"}], "partial output kept"
    assert store.get("resp_done", "bob") == StoredResponse(done, [], [])
    assert store.rewrite_unfinished(as_interrupted) == [], "nothing left unfinished"


def test_a_running_response_shows_its_output_and_cannot_be_continued(
    model_dir: Path, tmp_path: Path
) -> None:
    """While a background response runs, GET shows its output so far (the checkpoints), and a
    continuation is a 400 naming it; once it has finished, it continues."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = FakeEngine(tokenizer, max_model_len=4096, step_s=0.04)
    store = str(tmp_path / "r.sqlite3")
    settings = Settings(model=str(model_dir), served_model_name="tiny", response_store_path=store)
    app = create_app(engine, settings)  # type: ignore[arg-type]
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        r = http.post("/v1/responses", json=ask("Count", 100, background=True))
        assert r.status_code == 200, r.text
        rid = r.json()["id"]

        def shows_output() -> bool:
            got = http.get(f"/v1/responses/{rid}").json()
            return got["status"] == "in_progress" and bool(text_of(got))

        wait_for(shows_output, timeout_s=10, what="a checkpoint")
        follow = ask("More", 4, previous_response_id=rid)
        refused = http.post("/v1/responses", json=follow)
        error = assert_error_shape(refused.json(), 400)
        assert error["code"] == "previous_response_in_progress" and rid in error["message"]
        wait_for(lambda: http.get(f"/v1/responses/{rid}").json()["status"] == "incomplete")
        continued = http.post("/v1/responses", json=follow)
        assert continued.status_code == 200, continued.text


def test_an_unreadable_store_fails_only_the_responses_api(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    store = tmp_path / "r.sqlite3"
    store.write_bytes(b"not a database" * 100)
    engine = FakeEngine(AutoTokenizer.from_pretrained(str(model_dir)), step_s=0.0)
    settings = Settings(
        model=str(model_dir), served_model_name="tiny", response_store_path=str(store)
    )
    app = create_app(engine, settings)  # type: ignore[arg-type]
    with LiveServer(app) as live, httpx.Client(base_url=live.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        r = http.post("/v1/responses", json=ask("hi", 2))
        assert_error_shape(r.json(), 500)
    assert store.read_bytes() == b"not a database" * 100, "left as it was, for its owner"


# ---------------------------------------------------------------------------- the test


def test_sigkill_then_sigterm_mid_stream(model_dir: Path, tmp_path: Path) -> None:
    """One chain of three servers on one store (each start costs seconds of imports): killed
    mid-stream, restarted and checked, stopped mid-stream with a short grace, restarted and
    checked."""
    store = tmp_path / "responses.sqlite3"
    with serve(model_dir, store, tmp_path / "first.log") as first:
        completed, killed = kill_mid_stream(first)
    left = stored_rows(store)
    check_left_by_kill(left, completed, killed)

    with serve(model_dir, store, tmp_path / "second.log", grace_s=0.5) as second:
        with httpx.Client(base_url=second.url, timeout=60) as http:
            check_after_kill(http, left, completed, killed)
        more, cut = stop_mid_stream(second)
    log = (tmp_path / "second.log").read_text()
    assert f"{len(killed)} stored responses were cut by an earlier stop" in log, log[-3000:]
    assert log.index("were cut by an earlier stop") < log.index("ready on"), "before ready"
    left = stored_rows(store)
    check_left_by_stop(left, completed | more, cut)

    with serve(model_dir, store, tmp_path / "third.log") as third:
        with httpx.Client(base_url=third.url, timeout=60) as http:
            for reader in cut:
                assert http.get(f"/v1/responses/{reader.id}").json() == left[str(reader.id)]
            assert_serving_after(http, next(iter(more.values())), str(cut[0].id))
    assert "were cut by an earlier stop" not in (tmp_path / "third.log").read_text()
    after = stored_rows(store)  # and it still passes integrity_check
    assert not [r for r in after.values() if r["status"] in ("queued", "in_progress")]


# ---------------------------------------------------------------------------- SIGKILL


def kill_mid_stream(server: Server) -> tuple[dict[str, Any], list[Reader]]:
    """20 stored responses, then 8 streams and a background response running: SIGKILL. The
    background one comes last among the readers returned (it has no stream: no text)."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        completed = store_some(http, 20)
        background = start_background(http, server.url)
        readers = start_streams(server.url, 8)
        server.proc.send_signal(signal.SIGKILL)
        assert server.proc.wait(timeout=30) == -signal.SIGKILL
    for reader in readers:
        reader.join(timeout=30)
        assert not reader.is_alive() and reader.final is None, "every stream was cut"
    return completed, [*readers, background]


def check_left_by_kill(
    left: dict[str, Any], completed: dict[str, Any], killed: list[Reader]
) -> None:
    """What the dead process left: its responses in progress, each with output it had sent."""
    assert all(left[rid] == response for rid, response in completed.items())
    *streams, background = killed
    for reader in streams:
        assert left[str(reader.id)]["status"] == "in_progress"
        partial = text_of(left[str(reader.id)])
        assert partial and reader.text.startswith(partial), (partial, reader.text)
    assert left[str(background.id)]["status"] in ("queued", "in_progress")


def check_after_kill(
    http: httpx.Client, left: dict[str, Any], completed: dict[str, Any], killed: list[Reader]
) -> None:
    """After the restart: kept intact, or failed with the partial text; still serving."""
    for rid, response in completed.items():
        assert http.get(f"/v1/responses/{rid}").json() == response, "kept intact"
    for reader in killed:
        got = http.get(f"/v1/responses/{reader.id}").json()
        assert_cut(got)
        assert text_of(got) == text_of(left[str(reader.id)]), "its partial text kept"
    assert_serving_after(http, next(iter(completed.values())), str(killed[0].id))


# ---------------------------------------------------------------------------- SIGTERM


def stop_mid_stream(server: Server) -> tuple[dict[str, Any], list[Reader]]:
    """5 stored responses, then a background response and 4 streams running: SIGTERM, with a
    grace period (0.5 s) far too short for them. The responses that completed (a stream that
    finished within the grace among them), and what the stop cut (the background one last)."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        completed = store_some(http, 5)
        background = start_background(http, server.url)
        readers = start_streams(server.url, 4)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0, "a graceful stop exits cleanly"
    for reader in readers:
        reader.join(timeout=30)
        assert not reader.is_alive()
    cut = [r for r in readers if r.final is None or r.final["status"] == "failed"]
    assert cut, "the short grace cut the long streams"
    finished = {str(r.id): r.final for r in readers if r.final is not None and r not in cut}
    return completed | finished, [*cut, background]


def check_left_by_stop(left: dict[str, Any], completed: dict[str, Any], cut: list[Reader]) -> None:
    """The stop itself marked what it cut, with all the text it had sent, and told each stream
    so in a last `response.failed` event: nothing is left for the next start-up to mend."""
    assert all(left[rid] == response for rid, response in completed.items())
    assert not [r for r in left.values() if r["status"] in ("queued", "in_progress")]
    *streams, background = cut
    for reader in cut:
        response = left[str(reader.id)]
        assert_cut(response)
        assert text_of(response).startswith(reader.text)
        assert text_of(response), "the output so far"
    for reader in streams:
        assert reader.final == left[str(reader.id)], "the stream ends with response.failed"


def start_background(http: httpx.Client, url: str) -> Reader:
    """A long background response (a Reader never run: only its id)."""
    r = http.post("/v1/responses", json=ask("Count", LONG, background=True, ignore_eos=True))
    assert r.status_code == 200 and r.json()["status"] == "queued", r.text
    reader = Reader(url, {})
    reader.id = r.json()["id"]
    return reader
