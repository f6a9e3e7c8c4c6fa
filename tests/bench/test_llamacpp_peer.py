"""`specserve bench --peer llamacpp`: the CPU block, the llama.cpp server's command line and request
bodies, and whole runs with a fake llama.cpp server; one real run where llama-cpp-python is installed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from test_bench import FakeServer, _bench, _free_port, _tiny_config, _write_datasets, fake_server

from bench.serving import llamacpp, machine, orchestrate
from bench.serving.client import RequestSettings
from bench.serving.datasets import Prompt
from bench.serving.runner import Load, mode_order, modes_for

__all__ = ["fake_server"]  # a fixture these tests use

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
physical id\t: 0
core id\t: 0
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
physical id\t: 0
core id\t: 0
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile
"""


# ---------------------------------------------------------------- the machine


def test_cpuinfo_gives_model_cores_and_kernel_flags() -> None:
    info = machine.parse_cpuinfo(CPUINFO)
    assert info.model == "AMD EPYC 9R14 96-Core Processor"
    assert (info.logical_cpus, info.physical_cores) == (2, 1)  # two hyperthreads of one core
    assert info.kernel_flags == [
        "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
        "amx_tile",
    ]  # fmt: skip
    summary = info.summary()
    assert summary["cores"] == "1 physical, 2 logical"
    assert "avx512_vnni" in summary["cpu_flags"] and "fpu" not in summary["cpu_flags"]


def test_cmake_args_follow_the_cpu_and_leave_native_and_amx_off() -> None:
    avx512 = machine.llamacpp_cmake_args(machine.parse_cpuinfo(CPUINFO)).split()
    assert "-DGGML_NATIVE=OFF" in avx512 and "-DGGML_AVX512_VNNI=ON" in avx512
    assert "-DGGML_AMX_TILE=OFF" in avx512 and "-DGGML_AVX_VNNI=OFF" in avx512
    avx2_only = CPUINFO.replace(" avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile", "")
    args = machine.llamacpp_cmake_args(machine.parse_cpuinfo(avx2_only)).split()
    assert "-DGGML_AVX2=ON" in args and "-DGGML_AVX512=OFF" in args
    assert "-DGGML_AVX512_BF16=OFF" in args


def test_cpu_info_without_proc(tmp_path: Path) -> None:
    info = machine.cpu_info(tmp_path / "absent")
    assert info.logical_cpus >= 1 and info.flags == frozenset()


# ---------------------------------------------------------------- the server and its requests


def test_server_command_names_file_threads_and_context(tmp_path: Path) -> None:
    server = llamacpp.LlamaCppServer(tmp_path / "m.gguf", 2, 4096, python="/venv/bin/python")
    cmd = server.command(8123)
    assert cmd[:3] == ["/venv/bin/python", "-m", "llama_cpp.server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert flags == {
        "--model": str(tmp_path / "m.gguf"), "--n_threads": "2", "--n_threads_batch": "2",
        "--n_ctx": "4096", "--host": "127.0.0.1", "--port": "8123",
    }  # fmt: skip


def test_gguf_file_resolves_bundled_and_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match="specserve models fetch"):
        llamacpp.gguf_file("bundled:qwen2.5-coder-1.5b-instruct")
    bundled = tmp_path / "models" / "qwen2.5-coder-1.5b-instruct.gguf"
    bundled.parent.mkdir()
    bundled.write_bytes(b"GGUF")
    assert llamacpp.gguf_file("bundled:qwen2.5-coder-1.5b-instruct") == bundled
    assert llamacpp.gguf_file(str(bundled)) == bundled
    with pytest.raises(SystemExit, match="not one"):
        llamacpp.gguf_file(str(tmp_path))  # a transformers folder


def test_request_body_is_greedy_openai_sampling() -> None:
    chat = Prompt("chat", "c0", messages=(("user", "hi"),))
    body = llamacpp.request_body(chat, RequestSettings("m", 64, ignore_eos=True))
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["stream"]
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.0, 0, 1.0, 0.0)
    assert body["repeat_penalty"] == 1.0 and body["max_tokens"] == body["min_tokens"] == 64
    plain = llamacpp.request_body(Prompt("code", "p0", prompt="def f"), RequestSettings("m", 8))
    assert plain["prompt"] == "def f" and "min_tokens" not in plain
    assert "num_speculative_tokens" not in plain  # specserve's own fields stay at home


def test_three_modes_take_turns_at_c1_only() -> None:
    modes = modes_for(Load(concurrency=1), "llamacpp")
    assert modes == ("spec", "plain", "llamacpp")
    assert modes_for(Load(concurrency=4), "llamacpp") == ("spec", "plain")
    firsts = [mode_order(i, 0, modes)[0] for i in range(6)]
    assert firsts == ["spec", "plain", "llamacpp"] * 2
    assert all(sorted(mode_order(i, r, modes)) == sorted(modes) for i in range(3) for r in range(2))


def test_build_info_reads_the_system_info_line(tmp_path: Path) -> None:
    log = tmp_path / "llamacpp.log"
    log.write_text(
        "loading\nCPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 0 | REPACK = 1 | \n"
    )
    assert llamacpp.build_info(log) == "SSE3 AVX2 AVX512 REPACK"
    assert llamacpp.build_info(tmp_path / "absent") is None


# ---------------------------------------------------------------- a fake llama.cpp server


class FakeLlamaCpp:
    """llama-cpp-python's stream: text deltas without usage or token ids, one delta holding two
    tokens (a multi-byte character); it stops after 3 tokens unless min_tokens asks for more."""

    STEP_S = 0.01

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": "m.gguf", "object": "model"}]}

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> StreamingResponse:
            body = await request.json()
            self.bodies.append(body)
            return StreamingResponse(self.stream(body), media_type="text/event-stream")

        return app

    async def stream(self, body: dict[str, Any]) -> Any:
        chat = "messages" in body
        n = body["max_tokens"] if body.get("min_tokens") else min(3, body["max_tokens"])
        if chat:
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        sizes = [2] + [1] * (n - 2) if n > 2 else [1] * n
        for size in sizes:
            await asyncio.sleep(self.STEP_S * size)
            text = "é" if size == 2 else "x"
            part = {"delta": {"content": text}} if chat else {"text": text}
            yield _sse({"choices": [{"index": 0, "finish_reason": None, **part}]})
        reason = "length" if n == body["max_tokens"] else "stop"
        end: dict[str, Any] = {"delta": {}} if chat else {"text": ""}
        yield _sse({"choices": [{"index": 0, "finish_reason": reason, **end}]})
        yield "data: [DONE]\n\n"


def _sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


@contextlib.contextmanager
def _serving(app: FastAPI) -> Iterator[str]:
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_send_counts_tokens_by_delta_or_by_length() -> None:
    fake = FakeLlamaCpp()
    prompt = Prompt("chat", "c0", messages=(("user", "hi"),))

    async def both() -> list[Any]:
        async with httpx.AsyncClient(base_url=url) as client:
            early = await llamacpp.send(client, prompt, RequestSettings("m", 8))
            full = await llamacpp.send(client, prompt, RequestSettings("m", 8, ignore_eos=True))
            return [early, full]

    with _serving(fake.app()) as url:
        early, full = asyncio.run(both())
    assert (early.finish_reason, early.output_tokens) == ("stop", 2)  # 3 tokens in 2 deltas
    assert (full.finish_reason, full.output_tokens) == ("length", 8)  # exact: it ran to max_tokens
    assert full.mode == "llamacpp" and full.ok and len(full.itl_s) == 7 - 1


@pytest.fixture
def fake_llamacpp(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeLlamaCpp, list[Any]]]:
    """The launcher stubbed: it records the server it was asked for and serves the fake."""
    fake = FakeLlamaCpp()
    log = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 0 |\n"
    launched = launch_in_process(monkeypatch, fake.app(), log)
    monkeypatch.setattr(llamacpp, "installed", lambda: True)
    yield fake, launched


def launch_in_process(monkeypatch: pytest.MonkeyPatch, app: Any, log_line: str) -> list[Any]:
    """`llamacpp.launched_llamacpp` replaced: `app` served in this process, its log one line;
    returns the list the launched servers are appended to."""
    launched: list[Any] = []

    @contextlib.contextmanager
    def launch(server: Any, log_path: Path, timeout_s: float) -> Iterator[str]:
        launched.append(server)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(log_line)
        with _serving(app) as url:
            yield url

    monkeypatch.setattr(llamacpp, "launched_llamacpp", launch)
    return launched


def test_bench_with_llamacpp_peer(
    tmp_path: Path,
    fake_server: tuple[str, FakeServer],
    fake_llamacpp: tuple[FakeLlamaCpp, list[Any]],
) -> None:
    url, specserve = fake_server
    fake, launched = fake_llamacpp
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    code, chat = _write_datasets(tmp_path)
    out = tmp_path / "out"
    argv = ["--base-url", url, "--dataset", f"code={code}", "--dataset", f"chat={chat}"]
    argv += ["--concurrency", "1,2", "--num-prompts", "3", "--max-tokens", "8", "--ignore-eos"]
    argv += ["--repeats", "2", "--peer", "llamacpp", "--peer-model", str(gguf)]
    assert _bench([*argv, "--peer-threads", "2", "--out", str(out)]) == 0

    assert [(s.model_path, s.n_threads) for s in launched] == [(gguf, 2)]
    rows = json.loads((out / "results.json").read_text())
    peer = [r for r in rows if r["mode"] == "llamacpp"]
    assert {(r["category"], r["load"]) for r in peer} == {("code", "c=1"), ("chat", "c=1")}
    for row in peer:
        assert row["num_errors"] == 0 and row["output_tokens"] == 8 * 3  # exact, from "length"
    _check_ratios(rows)
    _check_same_prompts(fake, specserve)
    _check_interleaved(Path(json.loads((out / "meta.json").read_text())["raw_logs"]))
    _check_report((out / "report.md").read_text())


def _check_ratios(rows: list[dict[str, Any]]) -> None:
    for category in ("code", "chat"):
        at_c1 = {r["mode"]: r for r in rows if r["category"] == category and r["load"] == "c=1"}
        peer_tps = at_c1["llamacpp"]["decode_tokens_per_s"]
        for mode in ("spec", "plain"):
            row = at_c1[mode]
            each = row["ratio_vs_llamacpp"]
            assert each == pytest.approx(row["decode_tokens_per_s"] / peer_tps, rel=0.3)
        # The fake llama.cpp decodes a token each 10 ms, specserve's fake plain each 20 ms.
        assert at_c1["plain"]["ratio_vs_llamacpp"] < 1.0
        assert at_c1["llamacpp"]["ratio_vs_llamacpp"] == pytest.approx(1.0)
    assert all("ratio_vs_llamacpp" not in r for r in rows if r["load"] == "c=2")


def _check_same_prompts(fake: FakeLlamaCpp, specserve: FakeServer) -> None:
    measured = [b for b in fake.bodies if b["max_tokens"] == 8]
    texts = sorted(b["prompt"] if "prompt" in b else b["messages"][-1]["content"] for b in measured)
    plain = [text for mode, text in specserve.seen if mode == "plain"]
    # At c=1 each repeat sends every prompt once per mode; c=2 adds plain requests the peer skips.
    assert len(texts) == 2 * 6 and set(texts) == set(plain)
    assert all(b["temperature"] == 0 and b["min_tokens"] == 8 for b in measured)


def _check_interleaved(raw_logs: Path) -> None:
    """At c=1 the three modes run one prompt after another, the first one rotating."""
    records = [json.loads(line) for line in (raw_logs / "requests.jsonl").read_text().splitlines()]
    at_c1 = sorted((r for r in records if r["load"] == "c=1"), key=lambda r: r["start"])
    rounds = [at_c1[i : i + 3] for i in range(0, len(at_c1), 3)]
    assert all(len({r["prompt_id"] for r in rnd}) == 1 for rnd in rounds)
    assert all({r["mode"] for r in rnd} == {"spec", "plain", "llamacpp"} for rnd in rounds)
    firsts = [rnd[0]["mode"] for rnd in rounds]
    assert {firsts.count(m) for m in ("spec", "plain", "llamacpp")} == {len(rounds) // 3}


def _check_report(report: str) -> None:
    assert "## specserve vs llama.cpp (same GGUF file, concurrency 1)" in report
    header = next(line for line in report.splitlines() if line.startswith("| category | llama.cpp"))
    assert "specserve plain tok/s" in header and "specserve spec tok/s" in header
    row = next(line for line in report.splitlines() if line.startswith("| code |") and "x)" in line)
    assert row.count("x)") == 2  # both specserve modes carry their ratio to llama.cpp
    machine_block = report.split("## Machine", 1)[1].split("##", 1)[0]
    assert "- cpu_flags:" in machine_block and "- cores:" in machine_block
    assert "- llamacpp_build: `AVX2 AVX512 AVX512_VNNI`" in machine_block


def test_every_report_prints_the_machine(
    tmp_path: Path, fake_server: tuple[str, FakeServer]
) -> None:
    code, _ = _write_datasets(tmp_path)
    out = tmp_path / "out"
    argv = ["--base-url", fake_server[0], "--dataset", f"code={code}", "--concurrency", "1"]
    assert _bench([*argv, "--num-prompts", "1", "--max-tokens", "4", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    info = machine.cpu_info()
    assert f"- cpu: `{info.model}`" in report and "- cpu_flags:" in report
    assert "llama.cpp" not in report  # no peer, no comparison


def test_peer_refuses_what_it_cannot_compare(
    tmp_path: Path, fake_server: tuple[str, FakeServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _ = _write_datasets(tmp_path)
    argv = ["--base-url", fake_server[0], "--dataset", f"code={code}", "--peer", "llamacpp"]
    argv += ["--out", str(tmp_path / "out")]
    monkeypatch.setattr(llamacpp, "installed", lambda: False)
    with pytest.raises(SystemExit, match="make llamacpp"):
        _bench([*argv, "--concurrency", "1"])
    with pytest.raises(SystemExit, match="concurrency 1"):
        _bench([*argv, "--concurrency", "4"])
    monkeypatch.setattr(llamacpp, "installed", lambda: True)
    with pytest.raises(SystemExit, match="not one"):
        _bench([*argv, "--concurrency", "1", "--peer-model", str(tmp_path)])
    with pytest.raises(SystemExit, match="peer-model"):
        _bench([*argv, "--concurrency", "1"])  # --base-url: no config to read the model from


def test_default_raw_logs_go_to_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    args = orchestrate.argparse.Namespace(raw_logs=None, out=Path("bench-out"))
    path = orchestrate.raw_logs_dir(args)
    assert path.parent == tmp_path / "cache" / "bench-logs"
    assert path.name.startswith("bench-out-")


# ---------------------------------------------------------------- the real llama.cpp


def test_bench_against_real_llamacpp_on_a_tiny_gguf(tmp_path: Path, tiny_draft_dir: Path) -> None:
    """specserve and llama.cpp both serving one tiny GGUF file, one command."""
    pytest.importorskip("llama_cpp")
    from tiny import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf")
    config = _tiny_config(tmp_path / "tiny.yaml", gguf, tiny_draft_dir)
    meta, report = bench_a_real_peer(tmp_path, config, ["--peer", "llamacpp"], "llamacpp")
    assert meta["llamacpp_gguf"] == str(gguf) and meta["llamacpp_threads"] == 1
    assert meta["llamacpp_build"]  # what llama.cpp says it was built with
    assert "## specserve vs llama.cpp" in report


def bench_a_real_peer(
    tmp_path: Path, config: Path, peer_args: list[str], mode: str
) -> tuple[dict[str, Any], str]:
    """`specserve bench --launch CONFIG` with a real llama.cpp peer on one thread, 2 prompts of
    code and chat, 8 tokens: every peer row served all its tokens; the run's meta and report."""
    code, chat = _write_datasets(tmp_path)
    out = tmp_path / "out"
    argv = ["--launch", str(config), "--dataset", f"code={code}", "--dataset", f"chat={chat}"]
    argv += ["--concurrency", "1", "--num-prompts", "2", "--max-tokens", "8", "--ignore-eos"]
    assert _bench([*argv, *peer_args, "--peer-threads", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    peer = {r["category"]: r for r in rows if r["mode"] == mode}
    assert set(peer) == {"code", "chat"}
    for row in peer.values():
        assert row["num_errors"] == 0 and row["output_tokens"] == 8 * 2
        assert row["decode_tokens_per_s"] > 0
    return json.loads((out / "meta.json").read_text()), (out / "report.md").read_text()
