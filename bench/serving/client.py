"""One streamed OpenAI request, timed: TTFT, per-token gaps, end-to-end, the server's summary."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.serving.datasets import Prompt

# Names under which a response may carry its speculative summary (the server's own field first).
_SPEC_KEYS = ("spec_decode", "speculative", "speculation", "spec")


@dataclass(frozen=True)
class RequestSettings:
    model: str
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    prompt_id: str
    mode: str  # "spec" | "plain" | a peer's name ("llamacpp")
    ok: bool = False
    error: str | None = None
    start: float = 0.0  # monotonic send time
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one gap per token after the first
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_chunks: int = 0
    spec_summary: dict[str, Any] | None = None
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(prompt: Prompt, settings: RequestSettings, spec: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if settings.ignore_eos:
        body["ignore_eos"] = True
    if not spec:
        body["num_speculative_tokens"] = 0
    if prompt.response_format is not None:
        body["response_format"] = json.loads(prompt.response_format)
    if prompt.is_chat:
        body["messages"] = prompt.message_dicts()
    else:
        body["prompt"] = prompt.prompt
    return body


def endpoint(prompt: Prompt) -> str:
    return "/v1/chat/completions" if prompt.is_chat else "/v1/completions"


async def send_request(
    client: httpx.AsyncClient, prompt: Prompt, settings: RequestSettings, spec: bool
) -> RequestResult:
    body = request_body(prompt, settings, spec)
    mode = "spec" if spec else "plain"
    result = RequestResult(prompt.prompt_id, mode)
    return await send_body(client, endpoint(prompt), body, result, settings.timeout_s)


async def send_body(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    result: RequestResult,
    timeout_s: float,
) -> RequestResult:
    """POSTs a streaming `body` to `path` and fills `result` with what came back, and when."""
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            await _read_stream(resp, result)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _read_stream(resp: httpx.Response, result: RequestResult) -> None:
    last = result.start
    streamed_tokens = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))
            return
        _take_summary(chunk, result)
        result.finish_reason = _finish_reason(chunk) or result.finish_reason
        n = _tokens_in(chunk)
        if n == 0:
            continue
        now = time.perf_counter()
        if result.ttft_s is None:
            result.ttft_s = now - result.start
        else:
            # A speculative step delivers several tokens at once: each gets a share of the gap.
            result.itl_s.extend([(now - last) / n] * n)
        last = now
        streamed_tokens += n
        result.num_chunks += 1
    result.e2e_s = time.perf_counter() - result.start
    result.output_tokens = result.output_tokens or streamed_tokens
    result.ok = result.ttft_s is not None or result.output_tokens > 0


def _tokens_in(chunk: dict[str, Any]) -> int:
    """Tokens a chunk carries: its token_ids where the server sends them, else 1 per text delta."""
    total = 0
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids")
        if ids is not None:
            total += len(ids)
            continue
        delta = choice.get("delta") or {}
        text = delta.get("content") if "delta" in choice else choice.get("text")
        total += 1 if text else 0
    return total


def _finish_reason(chunk: dict[str, Any]) -> str | None:
    reasons = [c.get("finish_reason") for c in chunk.get("choices") or []]
    return next((r for r in reasons if r), None)


def _take_summary(chunk: dict[str, Any], result: RequestResult) -> None:
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens = int(usage.get("completion_tokens") or 0)
    for holder in (chunk, usage or {}, *(chunk.get("choices") or [])):
        for key in _SPEC_KEYS:
            if isinstance(holder.get(key), dict):
                result.spec_summary = holder[key]
    timings = chunk.get("timings")  # llama-server's: drafted and accepted tokens when it drafted
    if isinstance(timings, dict) and "draft_n" in timings:
        drafted, accepted = timings["draft_n"], timings.get("draft_n_accepted", 0)
        result.spec_summary = {"drafted_tokens": drafted, "accepted_tokens": accepted}
