"""vllm-router (PyPI) in front of two `specserve serve` replicas on the tiny model: requests
succeed through it, the cache-aware policy sends a repeated long prefix back to the replica that
cached it, and SIGTERM to one replica under load loses no request (the draining replica finishes
what it holds and answers 503 to new ones, which the router retries on the other)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_utils import free_port, metric_value, wait_for

pytestmark = pytest.mark.router

ROOT = Path(__file__).resolve().parents[2]
PREFIXES = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun. " * 4,
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n" * 4,
]


def router_binary() -> str:
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip("vllm-router is not installed (pip install -e '.[test]' installs it)")
    return found


@dataclass
class Proc:
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


def start(cmd: list[str], port: int, log: Path) -> Proc:
    with log.open("w") as out:
        popen = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    return Proc(f"http://127.0.0.1:{port}", popen, log)


def healthy(proc: Proc) -> bool:
    if proc.popen.poll() is not None:
        raise AssertionError(f"exited {proc.popen.returncode}:\n{proc.tail()}")
    try:
        return httpx.get(proc.url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def start_replica(model_dir: Path, work: Path, name: str) -> Proc:
    port = free_port()
    cmd = [
        sys.executable, "-m", "specserve", "serve", "--model", str(model_dir),
        "--served-model-name", "tiny", "--dtype", "float32", "--port", str(port),
        "--kv-cache-gib", "0.02", "--num-threads", "1", "--max-num-seqs", "8",
        "--shutdown-grace-s", "60",
    ]  # fmt: skip
    return start(cmd, port, work / f"{name}.log")


def start_router(replicas: list[Proc], policy: str, work: Path) -> Proc:
    port = free_port()
    cmd = [
        router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
        "--worker-urls", *(r.url for r in replicas),
        "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port()),
        # A stopped replica's circuit opens after 3 failures, so a retry cannot land on it
        # 5 times in a row (the default opens after 10, more than the 5 retries).
        "--cb-failure-threshold", "3",
        "--log-level", "warning",
    ]  # fmt: skip
    return start(cmd, port, work / f"router-{policy}.log")


@dataclass
class Cluster:
    replicas: list[Proc]
    cache_aware: Proc
    round_robin: Proc


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("router")
    procs: list[Proc] = []
    try:
        replicas = [start_replica(tiny_model_dir, work, f"replica-{i}") for i in range(2)]
        procs += replicas
        for replica in replicas:
            wait_for(lambda r=replica: healthy(r), timeout_s=180, what=f"{replica.url} ready")
        routers = [
            start_router(replicas, policy, work) for policy in ("cache_aware", "round_robin")
        ]
        procs += routers
        for router in routers:
            wait_for(lambda r=router: healthy(r), timeout_s=60, what="router ready")
        yield Cluster(replicas, *routers)
    finally:
        for proc in procs:
            proc.stop()


def complete(url: str, prompt: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def prompt_tokens_handled(replica: Proc) -> float:
    """Prompt tokens the replica computed or found in its prefix cache."""
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    return metric_value(text, "specserve:prompt_tokens_total", model_name="tiny") + metric_value(
        text, "vllm:prefix_cache_hits_total", model_name="tiny"
    )


def test_requests_succeed_through_the_router(cluster: Cluster) -> None:
    for router in (cluster.cache_aware, cluster.round_robin):
        out = complete(router.url, "Hello, world!", max_tokens=5)
        assert out["usage"]["completion_tokens"] == 5
        models = httpx.get(router.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
    before = [prompt_tokens_handled(r) for r in cluster.replicas]
    for i in range(4):
        complete(cluster.round_robin.url, f"{i} round robin")
    after = [prompt_tokens_handled(r) for r in cluster.replicas]
    assert all(a > b for a, b in zip(after, before, strict=True)), "round robin uses both"


def test_repeated_prefix_lands_on_the_replica_that_cached_it(cluster: Cluster) -> None:
    for prefix in PREFIXES:
        first = complete(cluster.cache_aware.url, prefix)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        before = [prompt_tokens_handled(r) for r in cluster.replicas]
        for n in range(3):
            again = complete(cluster.cache_aware.url, prefix + f" {n}")
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(prefix) // 8, f"repeat {n} missed the cache ({cached} tokens)"
        grew = [prompt_tokens_handled(r) > b for r, b in zip(cluster.replicas, before, strict=True)]
        assert grew.count(True) == 1, "every repeat went to one replica"


def test_sigterm_to_a_replica_under_load_loses_no_request(cluster: Cluster) -> None:
    victim, survivor = cluster.replicas
    url = cluster.round_robin.url
    prompts = [f"Request {i}: once upon a time there was" for i in range(24)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        early = [pool.submit(complete, url, p, 48) for p in prompts[:12]]
        wait_for(lambda: running(victim) > 0, timeout_s=60, what="the victim busy")
        victim.popen.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = [pool.submit(complete, url, p, 48) for p in prompts[12:]]
        results = [f.result(timeout=300) for f in early + late]
    assert [r["usage"]["completion_tokens"] for r in results] == [48] * len(prompts)
    assert victim.popen.wait(timeout=90) == 0, victim.tail()
    after_signal = victim.log.read_text().partition("signal 15")[2]
    assert '"POST /v1/completions HTTP/1.1" 200' in after_signal, "it finished what it held"
    assert healthy(survivor)


def running(replica: Proc) -> float:
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    return metric_value(text, "vllm:num_requests_running", model_name="tiny")
