"""`--launch`: start `specserve serve` (or a peer's server) on a free port, wait until it answers,
stop it afterwards."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_command(config: Path, port: int, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "specserve", "serve",
        "--config", str(config), "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def launched_server(
    config: Path, extra_args: list[str], log_path: Path, timeout_s: float = 1800.0
) -> Iterator[str]:
    """Yields the URL of a server started from `config`; stops it on exit, kills it on error."""
    port = free_port()
    with launched(serve_command(config, port, extra_args), port, log_path, timeout_s) as url:
        yield url


@contextlib.contextmanager
def launched(
    cmd: list[str], port: int, log_path: Path, timeout_s: float, health_path: str = "/health"
) -> Iterator[str]:
    """Yields the URL of the server `cmd` starts on `port`, once `health_path` answers 200."""
    print(f"bench: launching {' '.join(cmd)}  (log: {log_path})", file=sys.stderr)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base_url + health_path, proc, log_path, timeout_s)
            yield base_url
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        stop(proc)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    start = time.monotonic()
    last_note = 0.0
    while True:
        waited = time.monotonic() - start
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting:\n{tail(log)}")
        if _healthy(url):
            print(f"bench: server ready after {waited:.0f}s at {url}", file=sys.stderr)
            return
        if waited > timeout_s:
            raise TimeoutError(f"server not healthy after {timeout_s:.0f}s:\n{tail(log)}")
        if waited - last_note >= 10:
            print(
                f"bench: waiting for the server to load its models ({waited:.0f}s)", file=sys.stderr
            )
            last_note = waited
        time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
