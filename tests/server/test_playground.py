"""The playground page at `/` in a real headless browser (Playwright driving Debian's chromium)
against a live server on the tiny model, and the stream extension it reads (`return_token_origins`).

The browser tests skip, saying why, where Playwright or a chromium binary is missing; `.ci/run`
installs both."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from server_utils import RealServer, metric_value, real_server, wait_for

from server.app import create_app
from server.settings import Settings

CHROMIUM_FLAGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
PROMPT = "Write a Python function that adds two numbers."
SCHEMA = {
    "type": "object",
    "properties": {"answer_in_one_word": {"type": "string", "maxLength": 10}},
    "required": ["answer_in_one_word"],
    "additionalProperties": False,
}


def _chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RealServer]:
    """Hybrid speculation with the target as its own draft: most drafts are accepted, so the
    page has draft-model tokens to colour (the tiny random model's text rarely repeats)."""
    with real_server(
        tiny_model_dir, speculative_method="hybrid", draft_model=str(tiny_model_dir)
    ) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    executable = _chromium()
    if executable is None:
        pytest.skip("no chromium binary (apt-get install chromium; .ci/run does)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


class Page:
    """One fresh browser context (its own localStorage) on the playground, console errors kept."""

    def __init__(self, browser: Any, url: str, **context: Any) -> None:
        self.context = browser.new_context(**context)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url + "/")
        self.page.wait_for_function(
            "document.getElementById('model-name').textContent.includes('tiny')"
        )

    def settings(self, **values: str) -> None:
        for name, value in values.items():
            self.page.fill(f"#{name}", value)

    def send(self, prompt: str, button: str | None = None) -> None:
        self.page.fill("#prompt", prompt)
        if button is None:
            self.page.press("#prompt", "Enter")
        else:
            self.page.click(button)

    def wait_idle(self) -> None:
        self.page.wait_for_function("!document.getElementById('send').disabled", timeout=60_000)

    def spans(self, selector: str = ".msg.assistant .text") -> list[tuple[str, str]]:
        return [
            (el.get_attribute("data-origin"), el.text_content())
            for el in self.page.locator(selector).last.locator("span[data-origin]").all()
        ]


@pytest.fixture
def page(browser: Any, server: RealServer) -> Iterator[Page]:
    p = Page(browser, server.url)
    yield p
    p.context.close()
    assert not p.errors, f"console errors: {p.errors}"


def chat(server: RealServer, **body: Any) -> dict[str, Any]:
    request = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}]} | body
    r = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


# ---------------------------------------------------------------------------- the page


def test_the_page_loads_and_shows_the_server(page: Page) -> None:
    page.page.wait_for_function(
        "document.querySelector('#server dd[data-fig=running]').textContent === '0'"
    )
    assert page.page.title() == "specserve playground"
    assert page.page.locator(".legend li").count() == 4


def test_a_chat_streams_tokens_with_their_origins(page: Page, server: RealServer) -> None:
    page.settings(**{"max-tokens": "32", "temperature": "0"})
    page.send(PROMPT)
    page.wait_idle()
    spans = page.spans()
    assert len(spans) == 32
    origins = {origin for origin, _ in spans}
    assert "draft" in origins and origins <= {"draft", "ngram", "target"}
    # the page shows exactly what the API answers for the same greedy request
    whole = chat(server, max_tokens=32, temperature=0)
    assert "".join(text for _, text in spans) == whole["choices"][0]["message"]["content"]
    live = page.page.locator("#live")
    assert float(live.locator("dd[data-fig=tps]").text_content() or "0") > 0
    assert (live.locator("dd[data-fig=acceptance]").text_content() or "").endswith("%")
    assert float(live.locator("dd[data-fig=mal]").text_content() or "0") > 1
    # the conversation is kept in the browser: a reload shows it again
    page.page.reload()
    page.page.wait_for_selector(".msg.assistant span[data-origin]")
    assert page.spans() == spans


def test_compare_shows_both_speeds(page: Page) -> None:
    page.settings(**{"max-tokens": "24", "temperature": "0"})
    page.send(PROMPT, button="#compare")
    page.wait_idle()
    result = page.page.locator("#compare-result")
    assert result.is_visible()
    text = result.text_content() or ""
    assert text.startswith("speculative") and "plain" in text and text.count("tok/s") == 2
    speculative = page.spans(".pair [data-side=speculative]")
    plain = page.spans(".pair [data-side=plain]")
    assert {o for o, _ in plain} == {"target"}, "speculation off: every token is the target's"
    assert any(o != "target" for o, _ in speculative)
    assert [t for _, t in speculative] == [t for _, t in plain], "greedy output is lossless"


def test_a_json_schema_answer_shows_forced_tokens(page: Page) -> None:
    page.settings(**{"max-tokens": "40", "temperature": "0", "schema": json.dumps(SCHEMA)})
    page.send("Answer in JSON.")
    page.wait_idle()
    spans = page.spans()
    text = "".join(text for _, text in spans)
    assert json.loads(text).keys() == {"answer_in_one_word"}
    forced = "".join(text for origin, text in spans if origin == "grammar")
    assert len(forced) >= len(text) // 2, f"the key is forced: {forced!r} of {text!r}"


def test_stopping_a_stream_frees_the_request(page: Page, server: RealServer) -> None:
    server.throttle.delay_s = 0.05
    try:
        page.settings(**{"max-tokens": "400", "temperature": "0.8"})
        page.send(PROMPT)
        page.page.wait_for_function(
            "document.querySelectorAll('.msg.assistant span[data-origin]').length >= 3"
        )
        assert running(server) == 1
        page.page.click("#stop")
        page.wait_idle()
        wait_for(lambda: running(server) == 0, timeout_s=10, what="the request to be aborted")
    finally:
        server.throttle.delay_s = 0.0
    assert len(page.spans()) < 400, "the stopped answer stays in the conversation, cut short"
    assert page.page.locator(".msg.error").count() == 0


def test_server_errors_show_as_messages(page: Page) -> None:
    page.settings(**{"max-tokens": "100000000"})
    page.send(PROMPT)
    page.wait_idle()
    alert = page.page.locator(".msg.error[role=alert]")
    assert "context length" in (alert.text_content() or "")
    assert all("400 (Bad Request)" in e for e in page.errors), "the browser logs the 400 itself"
    page.errors.clear()


def test_a_phone_width_needs_no_sideways_scroll(browser: Any, server: RealServer) -> None:
    p = Page(browser, server.url, viewport={"width": 375, "height": 740}, is_mobile=True)
    try:
        assert not p.page.locator("#settings").is_visible()
        p.page.click("#settings-toggle")
        assert p.page.locator("#settings").is_visible()
        p.page.focus("#prompt")
        p.page.keyboard.type("Hi")
        p.page.keyboard.press("Enter")
        p.wait_idle()
        assert p.page.locator(".msg.assistant").count() == 1
        width = p.page.evaluate("document.documentElement.scrollWidth")
        assert width <= 375, f"the page is {width}px wide on a 375px screen"
    finally:
        p.context.close()
    assert not p.errors, p.errors


def running(server: RealServer) -> float:
    return metric_value(httpx.get(server.url + "/metrics").text, "specserve:num_requests_running")


# ---------------------------------------------------------------------------- the stream extension


def sse_chunks(server: RealServer, **body: Any) -> list[dict[str, Any]]:
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "temperature": 0,
        "max_tokens": 16,
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=request | body) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines.pop() == "[DONE]"
    return [json.loads(line) for line in lines]


def test_without_the_opt_in_the_stream_is_unchanged(server: RealServer) -> None:
    """The same greedy request with and without `return_token_origins`: the plain stream has none
    of the extension, and the extended one less its two additions is the plain one, chunk by chunk."""
    plain = sse_chunks(server)
    extended = sse_chunks(server, return_token_origins=True)
    assert len(plain) == len(extended)
    for before, after in zip(plain, extended, strict=True):
        (choice,) = before["choices"]
        assert "token_origins" not in choice
        assert choice["spec_decode"] is None or choice["finish_reason"] is not None
        (extra,) = after["choices"]
        spans = extra.pop("token_origins")
        assert "".join(s["text"] for s in spans) == (extra["delta"]["content"] or "")
        assert extra["spec_decode"] is not None, "the running totals come with every chunk"
        if extra["finish_reason"] is None:
            extra["spec_decode"] = None
        for chunk in (before, after):
            chunk.pop("id"), chunk.pop("created")
        assert after == before


def test_non_streamed_answers_carry_origins_too(server: RealServer) -> None:
    body = chat(server, max_tokens=12, temperature=0, return_token_origins=True)
    (choice,) = body["choices"]
    assert "".join(s["text"] for s in choice["token_origins"]) == choice["message"]["content"]
    assert len(choice["token_origins"]) == body["usage"]["completion_tokens"]
    assert "token_origins" not in chat(server, max_tokens=4)["choices"][0]
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=request | {"return_token_origins": True})
    (choice,) = r.json()["choices"]
    assert "".join(s["text"] for s in choice["token_origins"]) == choice["text"]
    assert {s["origin"] for s in choice["token_origins"]} <= {"draft", "ngram", "target"}


def test_the_page_can_be_turned_off_and_needs_no_key() -> None:
    with TestClient(create_app(None, Settings(model="none", playground=False))) as client:
        assert client.get("/").status_code == 404
    with TestClient(create_app(None, Settings(model="none", api_key="k"))) as client:
        page = client.get("/")
        assert page.status_code == 200 and "specserve playground" in page.text
        assert client.get("/playground/app.js").status_code == 200
        assert client.get("/playground/nothing.js").status_code == 404
        assert client.get("/v1/models").status_code == 401, "the API still needs the key"
