"""A real Prometheus (Debian's package) scrapes a live server during speculative requests; its
query API must give back what the requests themselves reported."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_utils import RealServer, free_port, real_server, wait_for

INSTALL = "apt-get install -y -q --no-install-recommends prometheus"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(i",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7",
    "Hello, world! How are you today? Hello, world! How are",
]


def prometheus_binary() -> str:
    """Debian's prometheus; installed quietly when missing (the test fails if that fails)."""
    found = shutil.which("prometheus")
    if found:
        return found
    env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
    cmd = f"(apt-get update -q || true) && {INSTALL}"
    if os.geteuid() != 0:
        cmd = f"sudo -n sh -c '{cmd}'"
    done = subprocess.run(cmd, shell=True, env=env, capture_output=True, text=True, timeout=600)
    found = shutil.which("prometheus")
    assert found, f"installing prometheus failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return found


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[RealServer]:
    with real_server(tiny_model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def prometheus(server: RealServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = prometheus_binary()
    work = tmp_path_factory.mktemp("prometheus")
    target = server.url.removeprefix("http://")
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: specserve\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    cmd = [
        binary,
        f"--config.file={work / 'prometheus.yml'}",
        f"--storage.tsdb.path={work / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url), timeout_s=60, what="prometheus ready")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(url: str, expr: str) -> float | None:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    result = r.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def scraped_value(url: str, expr: str, want: float) -> bool:
    value = query(url, expr)
    return value is not None and value == pytest.approx(want)


def test_prometheus_sees_what_the_requests_reported(server: RealServer, prometheus: str) -> None:
    drafts = "specserve:spec_decode_num_draft_tokens_total"
    # A first scrape at zero, so that rate() starts from the true beginning of the counters.
    wait_for(lambda: scraped_value(prometheus, drafts, 0.0), timeout_s=30, what="first scrape")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    drafted = accepted = 0
    ttfts: list[float] = []
    for i, prompt in enumerate(PROMPTS):
        start = time.monotonic()
        first: float | None = None
        summary: dict[str, Any] = {}
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=48, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.monotonic() - start
            summary = (chunk.model_extra or {}).get("spec_decode") or summary
        assert first is not None
        ttfts.append(first)
        drafted += summary["drafted_tokens"]
        accepted += summary["accepted_tokens"]
        if i == 1:
            time.sleep(1.5)  # spread the requests over several scrapes
    assert drafted > 0 and accepted > 0, "the prompts must exercise speculation"

    wait_for(lambda: scraped_value(prometheus, drafts, drafted), timeout_s=30, what="last scrape")
    accepted_total = query(prometheus, "specserve:spec_decode_num_accepted_tokens_total")
    assert accepted_total == accepted
    ratio = query(
        prometheus,
        "rate(specserve:spec_decode_num_accepted_tokens_total[5m])"
        " / rate(specserve:spec_decode_num_draft_tokens_total[5m])",
    )
    assert ratio == pytest.approx(accepted / drafted, rel=1e-6)
    per_pos = query(prometheus, "sum(specserve:spec_decode_num_accepted_tokens_per_pos_total)")
    assert per_pos == accepted

    count = query(prometheus, "specserve:time_to_first_token_seconds_count")
    assert count == len(PROMPTS)
    ttft_sum = query(prometheus, "specserve:time_to_first_token_seconds_sum")
    assert ttft_sum is not None and 0 < ttft_sum <= sum(ttfts) + 0.05
    mean = query(
        prometheus,
        "rate(specserve:time_to_first_token_seconds_sum[5m])"
        " / rate(specserve:time_to_first_token_seconds_count[5m])",
    )
    assert mean == pytest.approx(ttft_sum / len(PROMPTS), rel=1e-6)
    p99 = query(
        prometheus,
        "histogram_quantile(0.99, rate(specserve:time_to_first_token_seconds_bucket[5m]))",
    )
    assert p99 is not None and 0 < p99 <= 2.5, "tiny-model TTFTs land in the low buckets"
    finished = query(prometheus, 'specserve:request_success_total{finished_reason="length"}')
    assert finished == len(PROMPTS)
    generated = query(prometheus, "specserve:generation_tokens_total")
    assert generated == 48 * len(PROMPTS)
