"""llama.cpp as a peer: an OpenAI-compatible llama.cpp server on the GGUF file the specserve config
serves, with the same threads, prompts, greedy sampling and max tokens, measured in the same rounds
as specserve's plain and speculative modes (runner.py), at concurrency 1. Two servers:
- `llamacpp`: llama-cpp-python's `python -m llama_cpp.server` (the optional extra `llamacpp`);
- `llama-server`, `llama-server-draft`, `llama-server-ngram`: llama.cpp's own C++ server, plain or
  with its own speculative modes (llama_server.py).
This module launches either, sends them requests and reads what they say they were built with.

Sampling is made the OpenAI default that specserve applies: llama.cpp's own defaults
(top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1) would change greedy output and cost time.
llama-cpp-python's stream carries no usage and no token ids, so a request is counted as one token
per text delta, and as exactly max_tokens when it stopped for length (a delta can hold several
tokens that end in one multi-byte character); llama-server's stream ends with its usage.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import httpx

from bench.serving.client import RequestResult, RequestSettings, endpoint, send_body
from bench.serving.datasets import Prompt
from bench.serving.launcher import free_port, launched
from bench.serving.runner import PeerTarget

NAME = "llamacpp"
INSTALL_HINT = (
    "llama.cpp's server is not installed: `make llamacpp` (or pip install -e '.[llamacpp]' with "
    "CMAKE_ARGS from `python -m bench.serving.machine --cmake-args`); see docs/PEERS.md"
)


BodyFn = Callable[[Prompt, RequestSettings], dict[str, Any]]


class PeerServer(Protocol):
    """A llama.cpp server the bench can launch: its peer name, its command, where it says it is up."""

    @property
    def name(self) -> str: ...
    @property
    def model_path(self) -> Path: ...
    @property
    def n_threads(self) -> int: ...
    @property
    def health_path(self) -> str: ...
    def command(self, port: int) -> list[str]: ...
    def request_body(self, prompt: Prompt, settings: RequestSettings) -> dict[str, Any]: ...
    def build_info(self, log_path: Path) -> str | None: ...


@dataclass(frozen=True)
class LlamaCppServer:
    model_path: Path
    n_threads: int
    n_ctx: int = 4096
    python: str = sys.executable
    name: str = NAME
    health_path: str = "/v1/models"  # the model is loaded before the server starts listening

    def command(self, port: int) -> list[str]:
        return [
            self.python, "-m", "llama_cpp.server", "--model", str(self.model_path),
            "--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads),
            "--n_ctx", str(self.n_ctx), "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip

    def request_body(self, prompt: Prompt, settings: RequestSettings) -> dict[str, Any]:
        return request_body(prompt, settings)

    def build_info(self, log_path: Path) -> str | None:
        return build_info(log_path)


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_file(spec: str) -> Path:
    """The GGUF file behind a specserve model spec: `bundled:NAME` or a path to a .gguf file."""
    if spec.startswith("bundled:"):
        from engine.model.bundled import model_path

        try:
            path = model_path(spec.removeprefix("bundled:"))
        except KeyError:  # a shipped EAGLE-3 head (heads/), which llama.cpp cannot run
            raise SystemExit(
                f"{spec!r} is no bundled GGUF model (a head?): give --peer-model or "
                "--peer-draft-model FILE.gguf"
            ) from None
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run `specserve models fetch` first")
        return path
    path = Path(spec).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(
            f"llama.cpp reads GGUF files; the model {spec!r} is not one (give --peer-model FILE.gguf)"
        )
    return path


@contextlib.contextmanager
def launched_llamacpp(server: PeerServer, log_path: Path, timeout_s: float) -> Iterator[str]:
    """Yields the URL of a llama.cpp server once its health path answers; stops it on exit."""
    port = free_port()
    cmd = server.command(port)
    with launched(cmd, port, log_path, timeout_s, health_path=server.health_path) as url:
        yield url


def request_body(prompt: Prompt, settings: RequestSettings) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": settings.model,
        "max_tokens": settings.max_tokens,
        "temperature": settings.temperature,
        "top_k": 0,  # 0: no top-k cut (llama.cpp's default is 40)
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "stream": True,
    }
    if settings.ignore_eos:
        body["min_tokens"] = settings.max_tokens
    if prompt.response_format is not None:
        raise SystemExit(f"the llama.cpp peer does not take response_format ({prompt.prompt_id})")
    if prompt.is_chat:
        body["messages"] = prompt.message_dicts()
    else:
        body["prompt"] = prompt.prompt
    return body


async def send(
    client: httpx.AsyncClient,
    prompt: Prompt,
    settings: RequestSettings,
    name: str = NAME,
    body_of: BodyFn = request_body,
) -> RequestResult:
    result = RequestResult(prompt.prompt_id, name)
    body = body_of(prompt, settings)
    await send_body(client, endpoint(prompt), body, result, settings.timeout_s)
    if result.finish_reason == "length":
        result.output_tokens = settings.max_tokens
    return result


def peer_target(client: httpx.AsyncClient, server: PeerServer) -> PeerTarget:
    sender = partial(send, client, name=server.name, body_of=server.request_body)
    return PeerTarget(server.name, sender)


def build_info(log_path: Path) -> str | None:
    """The CPU features llama.cpp was compiled with, from the system_info line of its log."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = [line for line in lines if "system_info" in line or line.startswith("CPU :")]
    if not found:
        return None
    features = found[-1].partition("CPU :")[2] or found[-1]
    on = [
        part.split("=")[0].strip() for part in features.split("|") if part.strip().endswith("= 1")
    ]
    return " ".join(on) or found[-1].strip()
