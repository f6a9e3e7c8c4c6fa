"""`specserve bench --peer llama-server[-draft|-ngram]`: llama.cpp's own C++ server, its command line
per speculative mode, its request bodies, the errors when it cannot run, a whole run with a fake
server, and real runs where `make llama-server` has built the binary."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_bench import FakeServer, _bench, _tiny_config, _write_datasets, fake_server
from test_llamacpp_peer import FakeLlamaCpp, _sse, bench_a_real_peer, launch_in_process

from bench.serving import llama_server, llamacpp
from bench.serving.client import RequestSettings
from bench.serving.datasets import Prompt

__all__ = ["fake_server"]  # a fixture these tests use

HELP = "--spec-type none,draft-simple,draft-eagle3,ngram-simple,ngram-mod,ngram-cache   types\n"


def _server(tmp_path: Path, name: str, **kw: Any) -> llama_server.LlamaServer:
    return llama_server.LlamaServer(
        tmp_path / "llama-server", tmp_path / "m.gguf", 2, 4096, name, **kw
    )


def _flags(cmd: list[str]) -> dict[str, str]:
    return dict(zip(cmd[1::2], cmd[2::2], strict=True))


# ---------------------------------------------------------------- command lines and bodies


def test_plain_command_names_file_threads_context_one_slot_and_template(tmp_path: Path) -> None:
    cmd = _server(tmp_path, "llama-server").command(8123)
    assert cmd[0] == str(tmp_path / "llama-server") and "--jinja" in cmd
    cmd.remove("--jinja")
    assert _flags(cmd) == {
        "-m": str(tmp_path / "m.gguf"), "-t": "2", "-tb": "2", "-c": "4096", "-np": "1",
        "--host": "127.0.0.1", "--port": "8123",
    }  # fmt: skip


def test_draft_command_adds_the_draft_file_and_its_length(tmp_path: Path) -> None:
    draft = tmp_path / "d.gguf"
    server = _server(tmp_path, "llama-server-draft", draft_path=draft, draft_max=5)
    cmd = server.command(8123)
    cmd.remove("--jinja")
    flags = _flags(cmd)
    assert flags["-md"] == str(draft) and flags["--spec-draft-n-max"] == "5"
    assert flags["--spec-type"] == "draft-simple" and flags["-m"] == str(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="draft GGUF"):
        _server(tmp_path, "llama-server-draft")


def test_ngram_command_asks_for_ngram_mod(tmp_path: Path) -> None:
    cmd = _server(tmp_path, "llama-server-ngram").command(8123)
    assert cmd[-2:] == ["--spec-type", "ngram-mod"] and "-md" not in cmd
    with pytest.raises(ValueError, match="unknown llama-server peer"):
        _server(tmp_path, "llama-server-eagle")


def test_body_fixes_length_by_ignore_eos_and_asks_for_usage(tmp_path: Path) -> None:
    server = _server(tmp_path, "llama-server")
    chat = Prompt("chat", "c0", messages=(("user", "hi"),))
    body = server.request_body(chat, RequestSettings("m", 64, ignore_eos=True))
    assert body["ignore_eos"] and "min_tokens" not in body
    assert body["stream_options"] == {"include_usage": True}
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.0, 0, 1.0, 0.0)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    plain = server.request_body(Prompt("code", "p0", prompt="def f"), RequestSettings("m", 8))
    assert plain["prompt"] == "def f" and "ignore_eos" not in plain


def test_build_info_from_the_log_else_from_what_make_configured(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    server = llama_server.LlamaServer(tmp_path / "bin" / "llama-server", tmp_path / "m.gguf", 1)
    log = tmp_path / "llama-server.log"
    log.write_text("srv  load_model: loading model\n")
    assert server.build_info(log) is None
    (tmp_path / "llama-server").mkdir()
    (tmp_path / "llama-server" / "config").write_text(
        "0.3.36 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON "
        "-DGGML_AMX_TILE=OFF -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON\n"
    )
    assert server.build_info(log) == "AVX2 AVX512"
    log.write_text("system_info: n_threads = 1 | CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 |\n")
    assert server.build_info(log) == "SSE3 AVX2"  # what the binary itself says comes first


# ---------------------------------------------------------------- what stops a run


def _fake_binary(path: Path, help_text: str) -> Path:
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}EOF\n")
    path.chmod(0o755)
    return path


def test_spec_type_check_reads_the_binarys_help(tmp_path: Path) -> None:
    binary = _fake_binary(tmp_path / "llama-server", HELP)
    llama_server.check_spec_type(binary, "ngram-mod")
    old = _fake_binary(tmp_path / "old", "--spec-type none,draft-simple   types\n")
    with pytest.raises(SystemExit, match="has no --spec-type ngram-mod"):
        llama_server.check_spec_type(old, "ngram-mod")
    with pytest.raises(SystemExit, match="no --spec-type at all"):
        llama_server.check_spec_type(_fake_binary(tmp_path / "older", "-m FNAME\n"), "ngram-mod")


def test_runs_stop_with_a_clear_reason(tmp_path: Path, fake_server: tuple[str, FakeServer]) -> None:
    code, _ = _write_datasets(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["--base-url", fake_server[0], "--dataset", f"code={code}", "--concurrency", "1"]
    argv += ["--peer-model", str(gguf), "--out", str(tmp_path / "out")]
    absent = tmp_path / "absent" / "llama-server"
    with pytest.raises(SystemExit, match="make llama-server"):
        _bench([*argv, "--peer", "llama-server", "--llama-server", str(absent)])
    old = _fake_binary(tmp_path / "old", "--spec-type none,draft-simple   types\n")
    with pytest.raises(SystemExit, match="no --spec-type ngram-mod"):
        _bench([*argv, "--peer", "llama-server-ngram", "--llama-server", str(old)])
    with pytest.raises(SystemExit, match="peer-draft-model"):
        _bench([*argv, "--peer", "llama-server-draft", "--llama-server", str(old)])
    with pytest.raises(SystemExit, match="one llama.cpp peer per run"):
        _bench([*argv, "--peer", "llamacpp,llama-server"])


# ---------------------------------------------------------------- a fake llama-server


class FakeLlamaServer(FakeLlamaCpp):
    """llama-server's stream: a token a chunk, ignore_eos for a fixed length, then the usage chunk
    with its timings (every other drafted token accepted)."""

    async def stream(self, body: dict[str, Any]) -> Any:
        n = body["max_tokens"] if body.get("ignore_eos") else min(3, body["max_tokens"])
        chat = "messages" in body
        for _ in range(n):
            await asyncio.sleep(self.STEP_S)
            part = {"delta": {"content": "x"}} if chat else {"text": "x"}
            yield _sse({"choices": [{"index": 0, "finish_reason": None, **part}]})
        reason = "length" if n == body["max_tokens"] else "stop"
        yield _sse({"choices": [{"index": 0, "finish_reason": reason, "delta": {}}]})
        if body.get("stream_options", {}).get("include_usage"):
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
            timings = {"predicted_n": n, "draft_n": 2 * n, "draft_n_accepted": n}
            yield _sse({"choices": [], "usage": usage, "timings": timings})
        yield "data: [DONE]\n\n"


@pytest.fixture
def fake_llama_server(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[FakeLlamaServer, list[Any]]]:
    fake = FakeLlamaServer()
    log = "system_info: n_threads = 2 | CPU : AVX2 = 1 | AVX512 = 1 | \n"
    yield fake, launch_in_process(monkeypatch, fake.app(), log)


def test_bench_with_llama_server_draft_peer(
    tmp_path: Path,
    fake_server: tuple[str, FakeServer],
    fake_llama_server: tuple[FakeLlamaServer, list[Any]],
) -> None:
    fake, launched = fake_llama_server
    binary = _fake_binary(tmp_path / "llama-server", HELP)
    gguf, draft = tmp_path / "m.gguf", tmp_path / "d.gguf"
    gguf.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    code, chat = _write_datasets(tmp_path)
    out = tmp_path / "out"
    argv = ["--base-url", fake_server[0], "--dataset", f"code={code}", "--dataset", f"chat={chat}"]
    argv += ["--concurrency", "1", "--num-prompts", "2", "--max-tokens", "8", "--ignore-eos"]
    argv += ["--peer", "llama-server-draft", "--llama-server", str(binary)]
    argv += ["--peer-model", str(gguf), "--peer-draft-model", str(draft), "--peer-k", "5"]
    assert _bench([*argv, "--peer-threads", "2", "--out", str(out)]) == 0

    [server] = launched
    assert (server.name, server.draft_path, server.draft_max) == ("llama-server-draft", draft, 5)
    rows = json.loads((out / "results.json").read_text())
    peer = [r for r in rows if r["mode"] == "llama-server-draft"]
    assert {r["category"] for r in peer} == {"code", "chat"}
    for row in peer:
        assert row["num_errors"] == 0 and row["output_tokens"] == 8 * 2  # from usage
        assert row["acceptance_rate"] == pytest.approx(0.5)  # from timings
    assert all(r["ratio_vs_llama-server-draft"] for r in rows if r["mode"] in ("spec", "plain"))
    measured = [b for b in fake.bodies if b["max_tokens"] == 8]
    assert measured and all(b["ignore_eos"] and "min_tokens" not in b for b in measured)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["llamacpp_peer"] == "llama-server-draft" and meta["llamacpp_build"] == "AVX2 AVX512"
    assert "--spec-type draft-simple" in meta["llamacpp_command"]
    report = (out / "report.md").read_text()
    assert "## specserve vs llama-server draft (same GGUF file, concurrency 1)" in report
    assert "| category | llama-server draft tok/s |" in report


# ---------------------------------------------------------------- the real llama-server


def _real_binary() -> Path:
    binary = llama_server.default_binary()
    if not binary.is_file():
        pytest.skip(f"{binary} is absent: `make llama-server` builds it (about 12 min on 2 cores)")
    return binary


@pytest.mark.parametrize("name", llama_server.PEERS)
def test_real_llama_server_answers_in_each_mode(tmp_path: Path, name: str) -> None:
    """The built binary on a tiny GGUF (its own draft), one chat request of 8 tokens per mode."""
    binary = _real_binary()
    from tiny import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf")
    spec_type = llama_server.SPEC_TYPES[name]
    if spec_type is not None:
        llama_server.check_spec_type(binary, spec_type)
    server = llama_server.LlamaServer(binary, gguf, 1, 512, name, draft_path=gguf, draft_max=3)
    prompt = Prompt("chat", "c0", messages=(("user", "hi there"),))

    async def one(url: str) -> Any:
        async with httpx.AsyncClient(base_url=url) as client:
            target = llamacpp.peer_target(client, server)
            return await target.send(prompt, RequestSettings("tiny", 8, ignore_eos=True))

    log = tmp_path / f"{name}.log"
    with llamacpp.launched_llamacpp(server, log, timeout_s=120) as url:
        result = asyncio.run(one(url))
    assert result.ok and result.error is None, result.error
    assert (result.mode, result.output_tokens, result.finish_reason) == (name, 8, "length")
    assert result.prompt_tokens > 0  # from the usage chunk
    if name == "llama-server-draft":
        assert result.spec_summary and result.spec_summary["drafted_tokens"] > 0
    assert server.build_info(log)  # the features make configured: its log has no system_info


def test_bench_against_real_llama_server_on_a_tiny_gguf(
    tmp_path: Path, tiny_draft_dir: Path
) -> None:
    """specserve and llama-server (with a draft) serving one tiny GGUF file, one command."""
    _real_binary()
    from tiny import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf")
    draft = make_tiny_gguf(tmp_path / "draft.gguf", seed=1, num_layers=1)
    config = _tiny_config(tmp_path / "tiny.yaml", gguf, tiny_draft_dir)
    args = ["--peer", "llama-server-draft", "--peer-draft-model", str(draft)]
    meta, report = bench_a_real_peer(tmp_path, config, args, "llama-server-draft")
    assert meta["llamacpp_gguf"] == str(gguf) and meta["llamacpp_threads"] == 1
    assert f"-md {draft}" in meta["llamacpp_command"] and meta["llamacpp_build"]
    assert "## specserve vs llama-server draft" in report
