"""`specserve bench`: whole runs against live servers (a fake one, the engine on tiny models);
the dataset readers are tests/bench/test_bench_datasets.py."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse

from bench.serving import cli as bench_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


# ---------------------------------------------------------------- a fake streaming server


class FakeServer:
    """OpenAI-style SSE streaming with a fixed pace: speculative requests get 2 tokens per step."""

    STEP_S = 0.02

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []  # (mode, prompt text)
        self.primed: list[tuple[str, str, int]] = []  # (mode, prompt text, measured so far)
        self.drafts = 0

    def app(self) -> Any:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse(self.metrics_text())

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> StreamingResponse:
            body = await request.json()
            return StreamingResponse(self.stream(body), media_type="text/event-stream")

        return app

    def metrics_text(self) -> str:
        p = "specserve:spec_decode_"
        return (
            f"# TYPE {p}num_drafts counter\n{p}num_drafts_total {self.drafts}\n"
            f"# TYPE {p}num_draft_tokens counter\n{p}num_draft_tokens_total {3 * self.drafts}\n"
            f"# TYPE {p}num_accepted_tokens counter\n{p}num_accepted_tokens_total {self.drafts}\n"
            f"# TYPE {p}num_accepted_tokens_per_pos counter\n"
            f'{p}num_accepted_tokens_per_pos_total{{position="0"}} {self.drafts}\n'
            f'{p}num_accepted_tokens_per_pos_total{{position="1"}} 0\n'
            f'{p}num_accepted_tokens_per_pos_total{{position="2"}} 0\n'
        )

    async def stream(self, body: dict[str, Any]) -> Any:
        assert body["stream"] and body["stream_options"]["include_usage"]
        spec = body.get("num_speculative_tokens") != 0
        text = body["prompt"] if "prompt" in body else body["messages"][-1]["content"]
        if body["max_tokens"] > 4:  # warm-up requests are left out of the record
            self.seen.append(("spec" if spec else "plain", text))
        elif body["max_tokens"] == 1:
            self.primed.append(("spec" if spec else "plain", text, len(self.seen)))
        per_step = 2 if spec else 1
        left = body["max_tokens"]
        while left > 0:
            await asyncio.sleep(self.STEP_S)
            n = min(per_step, left)
            left -= n
            if spec:
                self.drafts += 1
            choice = {"index": 0, "text": "x" * n, "token_ids": [7] * n, "finish_reason": None}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        summary = {"num_drafts": 1, "drafted_tokens": 3, "accepted_tokens": 1} if spec else None
        usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"], "total_tokens": 0}
        yield f"data: {json.dumps({'choices': [], 'usage': usage, 'spec_decode': summary})}\n\n"
        yield "data: [DONE]\n\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeServer]]:
    import uvicorn

    fake = FakeServer()
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(fake.app(), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", fake
    server.should_exit = True
    thread.join(timeout=10)


def _bench(argv: list[str]) -> int:
    """`specserve bench argv`, its raw logs beside --out (not in the user's cache)."""
    parser = argparse.ArgumentParser()
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    if args.raw_logs is None:
        args.raw_logs = args.out.parent / "raw-logs"
    return int(args.func(args) or 0)


def _write_datasets(tmp_path: Path) -> tuple[Path, Path]:
    code, chat = tmp_path / "code.jsonl", tmp_path / "chat.jsonl"
    code.write_bytes(_jsonl([{"prompt": f"def f{i}():"} for i in range(3)]))
    chat.write_bytes(
        _jsonl([{"messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)])
    )
    return code, chat


ROW_FIELDS = {
    "category", "concurrency", "mode", "output_tokens_per_s", "ttft_p50_s", "ttft_p90_s",
    "ttft_p99_s", "itl_p50_s", "itl_p90_s", "itl_p99_s", "e2e_p50_s", "e2e_p90_s", "e2e_p99_s",
    "acceptance_rate", "mean_acceptance_length", "acceptance_per_pos", "speedup_vs_plain",
    "num_requests", "num_errors", "output_tokens", "repeats", "prompt_ids",
}  # fmt: skip


def _check_outputs(out: Path, categories: set[str], loads: set[int]) -> list[dict[str, Any]]:
    rows = json.loads((out / "results.json").read_text())
    assert isinstance(rows, list)
    rows = [r for r in rows if r["mode"] in ("spec", "plain")]  # peers are checked apart
    keys = {(r["category"], r["concurrency"], r["mode"]) for r in rows}
    assert keys == {(c, n, m) for c in categories for n in loads for m in ("spec", "plain")}
    for row in rows:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        assert row["num_errors"] == 0 and row["output_tokens"] > 0
        assert row["output_tokens_per_s"] > 0
        for name in ("ttft", "itl", "e2e"):
            p50, p90, p99 = (row[f"{name}_p{p}_s"] for p in (50, 90, 99))
            assert 0 <= p50 <= p90 <= p99
    for category in categories:
        for load in loads:
            spec, plain = (
                next(r for r in rows if (r["category"], r["concurrency"], r["mode"]) == key)
                for key in ((category, load, "spec"), (category, load, "plain"))
            )
            assert spec["prompt_ids"] == plain["prompt_ids"]  # the ratio compares the same prompts
            assert spec["num_requests"] == plain["num_requests"]
            ratio = spec["output_tokens_per_s"] / plain["output_tokens_per_s"]
            assert spec["speedup_vs_plain"] == pytest.approx(ratio)
            assert plain["speedup_vs_plain"] == pytest.approx(1.0)
    report = (out / "report.md").read_text()
    for category in categories:
        assert f"## {category}" in report
    for name in ("speedup.png", "acceptance_per_position.png", "latency.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"].startswith("specserve bench ") and meta["model"]
    assert not (out / "requests.jsonl").exists()  # raw logs stay out of the results folder
    lines = (Path(meta["raw_logs"]) / "requests.jsonl").read_text().splitlines()
    assert sum(r["num_requests"] for r in rows) == len(lines)
    return rows


def test_bench_against_fake_server(tmp_path: Path, fake_server: tuple[str, FakeServer]) -> None:
    url, fake = fake_server
    code, chat = _write_datasets(tmp_path)
    out = tmp_path / "out"
    argv = ["--base-url", url, "--dataset", f"code={code}", "--dataset", f"chat={chat}"]
    argv += ["--concurrency", "1,4", "--num-prompts", "3", "--max-tokens", "12", "--out", str(out)]
    assert _bench(argv) == 0
    rows = _check_outputs(out, {"code", "chat"}, {1, 4})

    # Both modes received exactly the same prompts, and as many times.
    spec_seen = sorted(text for mode, text in fake.seen if mode == "spec")
    plain_seen = sorted(text for mode, text in fake.seen if mode == "plain")
    assert spec_seen == plain_seen and len(spec_seen) == 2 * (3 + 4)
    # Every prompt was put in the prefix cache once, plainly, before anything was measured.
    assert sorted(fake.primed) == sorted(("plain", text, 0) for text in set(spec_seen))
    for row in rows:
        if row["mode"] == "spec":
            # The fake drafts 3 tokens per step and accepts exactly the first.
            assert row["acceptance_rate"] == pytest.approx(1 / 3)
            assert row["mean_acceptance_length"] == pytest.approx(2.0)
            assert row["acceptance_per_pos"] == pytest.approx([1.0, 0.0, 0.0])
            assert row["acceptance_rate_responses"] == pytest.approx(1 / 3)
            assert row["speedup_vs_plain"] > 1.0  # two tokens per step against one
        else:
            assert row["acceptance_rate"] is None


def _bench_code_twice(tmp_path: Path, url: str, *flags: str) -> Path:
    """The bench on two code prompts at c = 1, six tokens, two repeats, and `flags`."""
    code, _ = _write_datasets(tmp_path)
    out = tmp_path / "out"
    argv = ["--base-url", url, "--dataset", f"code={code}", "--concurrency", "1"]
    argv += ["--num-prompts", "2", "--max-tokens", "6", "--repeats", "2", *flags]
    assert _bench([*argv, "--out", str(out)]) == 0
    return out


def test_bench_request_rate_and_repeats(
    tmp_path: Path, fake_server: tuple[str, FakeServer]
) -> None:
    out = _bench_code_twice(tmp_path, fake_server[0], "--request-rate", "50", "--ignore-eos")
    rows = json.loads((out / "results.json").read_text())
    assert {r["load"] for r in rows} == {"c=1", "rate=50"}
    for row in rows:
        assert row["repeats"] == 2 and len(row["speedup_vs_plain_per_repeat"]) == 2
        assert row["num_requests"] == 2


def test_control_run_sends_both_modes_plain(
    tmp_path: Path, fake_server: tuple[str, FakeServer]
) -> None:
    url, fake = fake_server
    out = _bench_code_twice(tmp_path, url, "--control")
    assert {mode for mode, _ in fake.seen} == {"plain"} and len(fake.seen) == 2 * 2 * 2
    rows = json.loads((out / "results.json").read_text())
    spec = next(r for r in rows if r["mode"] == "spec")
    assert spec["acceptance_rate"] is None  # nothing drafted: the fake only drafts when asked
    assert 0.5 < spec["speedup_vs_plain"] < 2.0  # the same work both ways (the fake's pacing)
    report = (out / "report.md").read_text()
    assert "## A/A control" in report
    low, high = (f"{f(spec['speedup_vs_plain_per_repeat']):.2f}" for f in (min, max))
    assert f"x ({low}-{high})" in report  # each cell shows its repeats' range
    assert json.loads((out / "meta.json").read_text())["control"].startswith("A/A")


def test_launch_starts_waits_and_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--launch: a server process on a free port, ready on /health, stopped after the run."""
    import subprocess
    import sys

    from bench.serving import launcher

    script = tmp_path / "fake_serve.py"
    script.write_text(
        "import sys, time, uvicorn\n"
        "from test_bench import FakeServer\n"
        "time.sleep(0.5)  # a server that takes a while to load\n"
        "port = int(sys.argv[1])\n"
        "uvicorn.run(FakeServer().app(), host='127.0.0.1', port=port, log_level='warning')\n"
    )
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        assert cmd[1:5] == ["-m", "specserve", "serve", "--config"]
        port = cmd[cmd.index("--port") + 1]
        assert cmd[-2:] == ["--device", "cpu"]
        env = {**__import__("os").environ, "PYTHONPATH": f"{Path(__file__).parent}:{Path.cwd()}"}
        proc = real_popen([sys.executable, str(script), port], env=env, **kwargs)
        started.append(proc)
        return proc

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)
    code, _ = _write_datasets(tmp_path)
    config = tmp_path / "serve.yaml"
    config.write_text("model: unused\n")
    out = tmp_path / "out"
    argv = ["--launch", str(config), "--device", "cpu", "--dataset", f"code={code}"]
    argv += ["--concurrency", "2", "--num-prompts", "2", "--max-tokens", "4", "--out", str(out)]
    assert _bench(argv) == 0
    assert len(started) == 1 and started[0].poll() is not None  # stopped afterwards
    assert "server ready" in capsys.readouterr().err
    assert (tmp_path / "raw-logs" / "server.log").exists()
    assert len(json.loads((out / "results.json").read_text())) == 2


def test_launch_reports_a_server_that_dies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.serving import launcher

    monkeypatch.setattr(
        launcher, "serve_command", lambda *a: ["python3", "-c", "print('no model here'); exit(3)"]
    )
    with pytest.raises(RuntimeError, match="no model here"):
        with launcher.launched_server(tmp_path / "c.yaml", [], tmp_path / "server.log", 30):
            pass


# ---------------------------------------------------------------- the real engine, tiny models


def _tiny_config(path: Path, target: Path, draft: Path) -> Path:
    path.write_text(
        f"model: {target}\n"
        f"draft_model: {draft}\n"
        "served_model_name: tiny\n"
        "speculative_method: draft\n"
        "num_speculative_tokens: 3\n"
        "speculative_adaptive: false\n"  # every spec round drafts: the test checks acceptance fields
        "dtype: float32\n"
        "num_threads: 1\n"
        "max_model_len: 512\n"
        "kv_cache_gib: 0.05\n"
        "log_level: warning\n"
    )
    return path


def test_bench_against_tiny_model_server(
    tmp_path: Path, tiny_model_dir: Path, tiny_draft_dir: Path
) -> None:
    """The real `specserve serve` (launched from a config) with the tiny pair, peers included."""
    config = _tiny_config(tmp_path / "tiny.yaml", tiny_model_dir, tiny_draft_dir)
    code, chat = _write_datasets(tmp_path)
    out = tmp_path / "out"
    argv = ["--launch", str(config), "--dataset", f"code={code}", "--dataset", f"chat={chat}"]
    argv += ["--concurrency", "1,3", "--num-prompts", "2", "--max-tokens", "10", "--ignore-eos"]
    argv += ["--peers", "hf,hf-assisted,hf-prompt-lookup", "--peer-num-prompts", "1"]
    argv += ["--out", str(out)]
    assert _bench(argv) == 0

    rows = json.loads((out / "results.json").read_text())
    server_rows = _check_outputs(out, {"code", "chat"}, {1, 3})
    for row in server_rows:
        assert row["output_tokens"] == 10 * row["num_requests"]  # ignore_eos: fixed length
        if row["mode"] == "plain":
            assert row["acceptance_rate"] is None and row["num_drafts"] is None
            continue
        # /metrics deltas and the responses' own summaries count the same drafts.
        assert 0 <= row["acceptance_rate"] <= 1 and row["num_drafts"] > 0
        assert row["acceptance_rate"] == pytest.approx(row["acceptance_rate_responses"])
        assert row["mean_acceptance_length"] == pytest.approx(
            row["mean_acceptance_length_responses"]
        )
        per_pos = row["acceptance_per_pos"]
        assert len(per_pos) == 3 and all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
        accepted = sum(per_pos) * row["num_drafts"]
        assert accepted == pytest.approx(row["num_accepted_tokens"])

    peers = [r for r in rows if r["mode"].startswith("hf")]
    assert {(r["category"], r["mode"]) for r in peers} == {
        (c, m) for c in ("code", "chat") for m in ("hf", "hf-assisted", "hf-prompt-lookup")
    }
    for row in peers:
        assert row["concurrency"] == 1 and row["num_errors"] == 0
        assert row["output_tokens"] == 10 * 1
        assert row["ttft_p50_s"] > 0 and row["e2e_p50_s"] >= row["ttft_p50_s"]
        assert row["ratio_vs_server_plain"] > 0
        server_ids = next(r["prompt_ids"] for r in server_rows if r["category"] == row["category"])
        assert len(row["prompt_ids"]) == 1 and row["prompt_ids"][0] in server_ids
    raw = tmp_path / "raw-logs" / "requests.jsonl"
    requests = [json.loads(line) for line in raw.read_text().splitlines()]
    for row in peers:  # against specserve's plain decoding of the very same prompts, at c=1
        plain = [
            r
            for r in requests
            if (r["category"], r["load"], r["mode"]) == (row["category"], "c=1", "plain")
            and r["prompt_id"] in row["prompt_ids"]
        ]
        plain_tps = sum(r["output_tokens"] for r in plain) / sum(r["e2e_s"] for r in plain)
        assert row["ratio_vs_server_plain"] == pytest.approx(row["output_tokens_per_s"] / plain_tps)
    assert "## Peers" in (out / "report.md").read_text()


def test_gpu_script_is_valid_bash_with_known_flags() -> None:
    import re
    import subprocess

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    bench_cli.add_parser(sub)
    known = set(sub.choices["bench"]._option_string_actions)
    call = script.read_text().split('specserve" bench', 1)[1].split("\n\n", 1)[0]
    used = set(re.findall(r"(--[a-z-]+)", call))
    assert used and used <= known, used - known
    assert {"--launch", "--device", "--out", "--peers"} <= used


def test_spec_grid_modes_and_table() -> None:
    from bench.spec_grid import modes_of, table

    modes = modes_of([2, 4], ["draft", "ngram"], adaptive_k=3)
    names = [m.name for m in modes]
    assert names == ["plain", "adaptive", "draft k=2", "draft k=4", "ngram k=2", "ngram k=4"]
    assert modes[1].adaptive and modes[1].k == 3 and not any(m.adaptive for m in modes[2:])
    speed = {"plain": 1.0, "adaptive": 1.2, "draft k=2": 1.5, "draft k=4": 0.8}
    speed |= {"ngram k=2": 0.9, "ngram k=4": 1.0}
    rows = [
        {"category": "code", "concurrency": 1, "mode": m, "speedup": v} for m, v in speed.items()
    ]
    text = table(rows, names, [1])
    assert "| code | 1 | 1.00 | 1.20 | 1.50 | 0.80 | 0.90 | 1.00 | 0.80 |" in text  # 1.2 / 1.5
    more = modes_of([2], ["draft"], adaptive_k=3, other_ceilings=(3, 4))
    assert [(m.name, m.k, m.adaptive) for m in more[1:3]] == [
        ("adaptive", 3, True),
        ("adaptive k≤4", 4, True),
    ]
    rows4 = [
        *rows[:3],
        {"category": "code", "concurrency": 1, "mode": "adaptive k≤4", "speedup": 1.6},
    ]
    names4 = ["plain", "adaptive", "adaptive k≤4", "draft k=2"]
    assert "| 1.60 | 1.50 | 0.80 |" in table(rows4, names4, [1])  # not a fixed mode: 1.2 / 1.5
    rows[1] |= {"drafted": 40, "accepted": 30}  # a mode that drafted shows its acceptance
    assert "| code | 1 | 1.00 | 1.20 (0.75) | 1.50 |" in table(rows, names, [1])
    control = modes_of([2], ["draft"], adaptive_k=3, control=True)
    assert [(m.name, m.proposer, m.k) for m in control][-1] == ("plain again", "none", 0)
    rows_aa = [
        *rows[:3],
        {"category": "code", "concurrency": 1, "mode": "plain again", "speedup": 1.3},
    ]
    names_aa = ["plain", "adaptive", "draft k=2", "plain again"]
    assert "| 1.30 | 0.80 |" in table(rows_aa, names_aa, [1])  # the control is no fixed mode


def test_draft_vocab_coverage_counts_stop_ids_as_covered() -> None:
    from bench.draft_vocab import coverage

    tokens = [1, 5, 40, 99, 99]
    assert coverage(tokens, 10, frozenset()) == 0.4
    assert coverage(tokens, 10, frozenset({99})) == 0.8
    assert coverage([], 10, frozenset()) == 0.0
