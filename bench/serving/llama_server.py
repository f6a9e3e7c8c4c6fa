"""llama.cpp's own C++ `llama-server` as a peer, built by `make llama-server` from the llama.cpp that
the pinned llama-cpp-python vendors, with the CPU switches of `make llamacpp` (docs/PEERS.md).

Three peers, one llama.cpp speculative mode each:
- `llama-server`: plain decoding;
- `llama-server-draft`: the config's draft GGUF as llama.cpp's draft model (`--spec-type
  draft-simple`), at most the config's num_speculative_tokens drafted per step;
- `llama-server-ngram`: llama.cpp's `ngram-mod` n-gram speculation, at its own defaults.

One slot (`-np 1`), the chat template the GGUF carries (`--jinja`, as specserve renders it), the
same threads for prompt and decode. Its stream ends with usage (exact token counts) and timings
(drafted and accepted tokens), which client.py reads.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serving import llamacpp
from bench.serving.client import RequestSettings
from bench.serving.datasets import Prompt

NAME = "llama-server"
SPEC_TYPES = {
    "llama-server": None,
    "llama-server-draft": "draft-simple",
    "llama-server-ngram": "ngram-mod",
}
PEERS = tuple(SPEC_TYPES)
INSTALL_HINT = (
    "llama.cpp's llama-server is not built at {path}: `make llama-server` (docs/PEERS.md)"
)


def default_binary() -> Path:
    """Where `make llama-server` installs it: beside this interpreter, in the venv's bin/."""
    return Path(sys.executable).parent / NAME


@dataclass(frozen=True)
class LlamaServer:
    binary: Path
    model_path: Path
    n_threads: int
    n_ctx: int = 4096
    name: str = NAME  # one of PEERS: which speculative mode
    draft_path: Path | None = None  # llama-server-draft's draft GGUF
    draft_max: int = 3  # llama-server-draft's most drafted tokens per step
    health_path: str = "/health"  # 503 while the model loads, 200 once it serves

    def __post_init__(self) -> None:
        if self.name not in SPEC_TYPES:
            raise ValueError(f"unknown llama-server peer {self.name!r}; known: {', '.join(PEERS)}")
        if self.name == "llama-server-draft" and self.draft_path is None:
            raise ValueError("llama-server-draft needs a draft GGUF")

    def command(self, port: int) -> list[str]:
        return [
            str(self.binary), "-m", str(self.model_path),
            "-t", str(self.n_threads), "-tb", str(self.n_threads), "-c", str(self.n_ctx),
            "-np", "1", "--jinja", "--host", "127.0.0.1", "--port", str(port),
            *self.spec_flags(),
        ]  # fmt: skip

    def spec_flags(self) -> list[str]:
        spec_type = SPEC_TYPES[self.name]
        if spec_type is None:
            return []
        if spec_type == "draft-simple":
            draft = ["-md", str(self.draft_path), "--spec-draft-n-max", str(self.draft_max)]
            return [*draft, "--spec-type", spec_type]
        return ["--spec-type", spec_type]

    def request_body(self, prompt: Prompt, settings: RequestSettings) -> dict[str, Any]:
        """llama-cpp-python's body, but llama-server's own words for a fixed length (ignore_eos:
        the end-of-generation tokens banned) and a final usage chunk."""
        body = llamacpp.request_body(prompt, settings)
        body.pop("min_tokens", None)
        body["stream_options"] = {"include_usage": True}
        if settings.ignore_eos:
            body["ignore_eos"] = True
        return body

    def build_info(self, log_path: Path) -> str | None:
        """The CPU features it was built with: its log's system_info line where it wrote one, else
        the switches `make llama-server` configured it with (the server logs system_info only at
        trace verbosity, whose logging would slow its decoding)."""
        return llamacpp.build_info(log_path) or configured_features(self.binary)


def configured_features(binary: Path) -> str | None:
    """The GGML switches that were ON in the configure record of `make llama-server`
    ($(VENV)/llama-server/config beside $(VENV)/bin/llama-server)."""
    try:
        words = (binary.parent.parent / "llama-server" / "config").read_text().split()
    except OSError:
        return None
    on = [
        w[len("-DGGML_") : -len("=ON")]
        for w in words
        if w.startswith("-DGGML_") and w.endswith("=ON")
    ]
    return " ".join(on) or None


def check_binary(binary: Path) -> None:
    if not binary.is_file():
        raise SystemExit(INSTALL_HINT.format(path=binary))


def check_spec_type(binary: Path, spec_type: str) -> None:
    """Stops with a clear message when this build's `--spec-type` does not list `spec_type`."""
    shown = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    lines = [line for line in shown.stdout.splitlines() if "--spec-type" in line]
    if not any(spec_type in line.replace(",", " ").split() for line in lines):
        listed = " / ".join(line.strip() for line in lines) or "no --spec-type at all"
        raise SystemExit(
            f"{binary} has no --spec-type {spec_type} (its --help: {listed}); docs/PEERS.md"
        )
