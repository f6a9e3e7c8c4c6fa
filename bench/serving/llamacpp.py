"""llama.cpp as a peer: its OpenAI-compatible server (llama-cpp-python's `python -m llama_cpp.server`,
the optional extra `llamacpp`) on the GGUF file the specserve config serves, with the same threads,
prompts, greedy sampling and max tokens, measured in the same rounds as specserve's plain and
speculative modes (runner.py), at concurrency 1 (its server decodes one request at a time).

Sampling is made the OpenAI default that specserve applies: llama-cpp-python's own defaults
(top-k 40, top-p 0.95, min-p 0.05, repeat penalty 1.1) would change greedy output and cost time.
Its stream carries no usage and no token ids, so a request is counted as one token per text delta,
and as exactly max_tokens when it stopped for length (a delta can hold several tokens that end in
one multi-byte character).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class LlamaCppServer:
    model_path: Path
    n_threads: int
    n_ctx: int = 4096

    def command(self, python: str, port: int) -> list[str]:
        return [
            python, "-m", "llama_cpp.server", "--model", str(self.model_path),
            "--n_threads", str(self.n_threads), "--n_threads_batch", str(self.n_threads),
            "--n_ctx", str(self.n_ctx), "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_file(spec: str) -> Path:
    """The GGUF file behind a specserve model spec: `bundled:NAME` or a path to a .gguf file."""
    if spec.startswith("bundled:"):
        from engine.model.bundled import model_path

        path = model_path(spec.removeprefix("bundled:"))
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
def launched_llamacpp(
    server: LlamaCppServer, python: str, log_path: Path, timeout_s: float
) -> Iterator[str]:
    """Yields the URL of a llama.cpp server; stops it on exit. It is up once /v1/models answers
    (the model is loaded before the server starts listening)."""
    port = free_port()
    cmd = server.command(python, port)
    with launched(cmd, port, log_path, timeout_s, health_path="/v1/models") as url:
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
    client: httpx.AsyncClient, prompt: Prompt, settings: RequestSettings
) -> RequestResult:
    result = RequestResult(prompt.prompt_id, NAME)
    body = request_body(prompt, settings)
    await send_body(client, endpoint(prompt), body, result, settings.timeout_s)
    if result.finish_reason == "length":
        result.output_tokens = settings.max_tokens
    return result


def peer_target(client: httpx.AsyncClient) -> PeerTarget:
    return PeerTarget(NAME, partial(send, client))


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
