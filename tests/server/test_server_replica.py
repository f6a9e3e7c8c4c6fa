"""The replica contract routers and autoscalers read: vLLM's metric names beside specserve's (same
values), `/live` for liveness and `/health` for readiness through a drain, `Retry-After` on 429/503."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import FakeEngine, LiveServer, free_port, real_server

from server.app import create_app
from server.metrics import VLLM_ALIASES, Metrics
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun. " * 3


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, parsed by prometheus_client: (name, labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def renamed_samples(all_samples: dict[Any, float], old: str, new: str) -> dict[Any, float]:
    return {
        (name.replace(old, new, 1), labels): v
        for (name, labels), v in all_samples.items()
        if name == old or name.startswith(old + "_total")
    }


def test_vllm_aliases_carry_the_specserve_values(tiny_model_dir: Path) -> None:
    with real_server(tiny_model_dir) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        for _ in range(2):  # the second request hits the prefix cache
            body = {"prompt": PREFIX, "max_tokens": 4}
            assert http.post("/v1/completions", json=body).status_code == 200
        parsed = samples(http.get("/metrics").text)
        num_blocks = live.engine.num_kv_blocks
    for name, aliases in VLLM_ALIASES.items():
        source = renamed_samples(parsed, f"specserve:{name}", "@")
        assert source, f"specserve:{name} missing"
        for alias in aliases:
            assert renamed_samples(parsed, alias, "@") == source, alias
    labels = {"model_name": "tiny", "block_size": "16", "num_gpu_blocks": str(num_blocks)}
    assert parsed[("vllm:cache_config_info", tuple(sorted(labels.items())))] == 1.0
    hits = parsed[("vllm:prefix_cache_hits_total", (("model_name", "tiny"),))]
    queries = parsed[("vllm:gpu_prefix_cache_queries_total", (("model_name", "tiny"),))]
    assert 0 < hits < queries, "the repeated prompt hit the cache, the first did not"
    assert parsed[("vllm:num_requests_running", (("model_name", "tiny"),))] == 0


def test_metrics_compat_none_exports_only_specserve_names() -> None:
    names = {f.name for f in text_string_to_metric_families(Metrics("m", "none").render().decode())}
    assert names and all(n.startswith("specserve:") for n in names)
    names = {f.name for f in text_string_to_metric_families(Metrics("m").render().decode())}
    assert "vllm:num_requests_waiting" in names, "vllm is the default"


def test_metrics_compat_setting_from_file_env_and_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specserve.cli import build_parser

    config = tmp_path / "c.yaml"
    config.write_text("model: m\nmetrics_compat: none\n")
    assert Settings.load(config).metrics_compat == "none"
    monkeypatch.setenv("SPECSERVE_METRICS_COMPAT", "vllm")
    assert Settings.load(config).metrics_compat == "vllm"
    args = build_parser().parse_args(["serve", "--model", "m", "--metrics-compat", "none"])
    assert args.metrics_compat == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--metrics-compat", "sglang"])


def fake_app(tiny_model_dir: Path, **engine_kw: Any) -> tuple[Any, FakeEngine]:
    from transformers import AutoTokenizer

    engine = FakeEngine(AutoTokenizer.from_pretrained(str(tiny_model_dir)), **engine_kw)
    settings = Settings(model=str(tiny_model_dir), served_model_name="tiny", max_waiting_requests=2)
    return create_app(engine, settings), engine  # type: ignore[arg-type]


def test_retry_after_on_429_and_503(tiny_model_dir: Path) -> None:
    app, engine = fake_app(tiny_model_dir)
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as http:
        body = {"prompt": "hi", "max_tokens": 2}
        assert "retry-after" not in http.post("/v1/completions", json=body).headers
        engine.num_waiting = 2
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        app.state.server.shutting_down = True
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        health = http.get("/health")
        assert health.status_code == 503 and int(health.headers["retry-after"]) > 0


def test_live_is_503_once_the_engine_died(tiny_model_dir: Path) -> None:
    app, engine = fake_app(tiny_model_dir, die_after_steps=1)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    with LiveServer(app) as live:
        assert httpx.get(live.url + "/live").status_code == 200
        assert httpx.post(live.url + "/v1/chat/completions", json=body).status_code == 503
        assert engine.dead
        assert httpx.get(live.url + "/live").status_code == 503
        assert httpx.get(live.url + "/health").status_code == 503


def test_live_and_health_through_load_and_drain(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Loading: live, not ready. Ready: both. SIGTERM: not ready, still live and still listening
    while the running stream finishes; then exit 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "specserve", "serve", "--model", str(tiny_model_dir),
        "--dtype", "float32", "--port", str(port), "--kv-cache-gib", "0.02",
        "--shutdown-grace-s", "30", "--num-threads", "1",
    ]  # fmt: skip
    with (tmp_path / "serve.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        seen = probe_until_ready(url, proc)
        assert (200, 503) in seen, f"live but not ready while loading: {seen}"
        assert seen[-1] == (200, 200)
        body = {"prompt": "Hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)  # the signal is handled asynchronously
                with httpx.Client(base_url=url, timeout=10) as probe:
                    draining = probe.get("/health")
                    assert probe.get("/live").status_code == 200, "live while draining"
                    refused = probe.post("/v1/completions", json={"prompt": "hi"})
                rest = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert draining.status_code == 503 and draining.json() == {"status": "shutting_down"}
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def probe_until_ready(url: str, proc: subprocess.Popen[bytes]) -> list[tuple[int, int]]:
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            seen.append(
                (httpx.get(url + "/live").status_code, httpx.get(url + "/health").status_code)
            )
        except httpx.TransportError:
            pass
        if seen and seen[-1][1] == 200:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"server never became ready (exit {proc.poll()}, probes {seen})")
