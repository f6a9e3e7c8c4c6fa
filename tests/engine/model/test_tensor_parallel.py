"""Tensor parallelism on gloo: `specserve serve --tensor-parallel-size 2` gives the greedy tokens
of the unsharded engine (float32, two model families, speculation on and off, n-gram and draft
model), and a rank that dies takes the server to a non-zero exit instead of a hang."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_utils import free_port
from tiny import make_tiny_model

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner
from engine.model.shape import DecoderShape
from engine.model.sharding import check_shardable, local_shape, shard_decoder
from engine.model.tensor_parallel import TensorParallel
from engine.sample.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(i",
    "Hello, world! How are you today?",
]
MAX_TOKENS = 24
K = 3


def shape(**kw: Any) -> DecoderShape:
    base: dict[str, Any] = dict(
        vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, qkv_bias=False, o_bias=False,
        qk_norm=False, tie_word_embeddings=True,
    )  # fmt: skip
    return DecoderShape(**(base | kw))


def test_local_shape_splits_heads_and_replicates_kv_heads_past_their_count() -> None:
    two = local_shape(shape(), 2)
    assert (two.num_heads, two.num_kv_heads, two.intermediate_size) == (2, 1, 64)
    four = local_shape(shape(), 4)
    assert (four.num_heads, four.num_kv_heads, four.intermediate_size) == (1, 1, 32)
    check_shardable(shape(), 4)
    for bad in (3, 8):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            check_shardable(shape(), bad)


def test_tensor_parallel_needs_a_different_draft() -> None:
    spec = SpeculativeConfig(method="draft", draft_model="m")
    with pytest.raises(ValueError, match="different model"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative=spec)


class ThreadGroup:
    """All-reduce among threads, summing in rank order on every rank (as one gloo group would)."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.parts: list[torch.Tensor | None] = [None] * world_size

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        total = torch.stack([p for p in self.parts if p is not None]).sum(0)
        self.barrier.wait()
        return x.copy_(total)


@dataclass(frozen=True)
class ThreadTP(TensorParallel):
    group: ThreadGroup = field(default_factory=lambda: ThreadGroup(1))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.rank, x)


# Gemma 3: a local layer whose window (8) the 20-token prompt passes, then a global one
GEMMA3 = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
# the switches other families turn on: Granite's multipliers, SmolLM3's second layer NoPE
CONFIGS: dict[str, dict[str, Any]] = {
    "gemma3": GEMMA3,
    "granite": dict(embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.5,
                    logits_scaling=2.0),
    "smollm3": dict(no_rope_layer_interval=2),
}  # fmt: skip


@pytest.mark.parametrize(
    "family", ["qwen2", "llama", "qwen3", "gemma3", "phi3", "granite", "smollm3"]
)
@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_reproduce_the_whole_model(
    family: str, world_size: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """TP 2 splits the 2 KV heads; TP 4 replicates each on two ranks. Every rank ends with the
    unsharded logits (prefill of two requests, then a decode step over the cached prefix)."""
    config = CONFIGS.get(family, {})
    model_dir = make_tiny_model(tmp_path_factory.mktemp(family), family=family, seed=5, **config)
    steps = [
        [ForwardInput(list(range(5, 25)), 0, [0, 1], 20), ForwardInput([7, 8, 9], 0, [2], 3)],
        [ForwardInput([30], 20, [0, 1], 1), ForwardInput([31, 32], 3, [2], 2)],
    ]
    whole = ModelRunner(load_model(str(model_dir)), "cpu", "float32", 16)
    whole.allocate_kv_cache(8)
    group, results = ThreadGroup(world_size), [None] * world_size
    runners = []
    for rank in range(world_size):
        runner = ModelRunner(load_model(str(model_dir)), "cpu", "float32", 16)
        shard_decoder(runner.model, ThreadTP(rank, world_size, str(model_dir), group))
        runner.allocate_kv_cache(8)
        runners.append(runner)
    assert runners[0].kv_caches[0][0].shape[0] == max(1, 2 // world_size), "local KV heads"
    for step in steps:
        expected = whole.forward(step)

        def rank_main(rank: int, step: list[ForwardInput] = step) -> None:
            results[rank] = runners[rank].forward(step)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for logits in results:
            torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)
            assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Untied embeddings, no biases (qwen2 has q/k/v biases and tied embeddings)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), family="llama", seed=3)


def reference_tokens(model_dir: Path, draft_dir: Path | None) -> dict[tuple[str, int], list[int]]:
    """The unsharded engine's greedy tokens per (prompt, k): k = 0 is speculation off."""
    spec = SpeculativeConfig(
        method="draft" if draft_dir else "ngram", num_speculative_tokens=K, adaptive=False,
        draft_model=str(draft_dir) if draft_dir else None,
    )  # fmt: skip
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), dtype="float32", kv_cache_gib=0.02, speculative=spec)
    )
    out = {}
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        for k in (0, K):
            params = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, num_speculative_tokens=k
            )
            (seq,) = engine.generate([ids], params)
            out[(prompt, k)] = list(seq.token_ids[len(ids) :])
    return out


def serve_tp(model_dir: Path, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "specserve", "serve", "--model", str(model_dir),
        "--served-model-name", "tiny", "--dtype", "float32", "--port", str(port),
        "--kv-cache-gib", "0.02", "--num-threads", "1", "--tensor-parallel-size", "2",
        "--num-speculative-tokens", str(K), "--no-speculative-adaptive", *extra,
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, log)
    return proc, url


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the tensor-parallel server never became ready")


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def completion(url: str, prompt: str, k: int) -> dict[str, Any]:
    body = {
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, "num_speculative_tokens": k,
    }  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.mark.parametrize("case", ["qwen2-ngram", "llama-ngram", "qwen2-draft"])
def test_tp2_gives_the_greedy_tokens_of_tp1(
    case: str, tiny_model_dir: Path, tiny_draft_dir: Path, llama_dir: Path, tmp_path: Path
) -> None:
    family, method = case.split("-")
    model_dir = llama_dir if family == "llama" else tiny_model_dir
    draft_dir = tiny_draft_dir if method == "draft" else None
    expected = reference_tokens(model_dir, draft_dir)
    extra = ["--speculative-method", method]
    extra += ["--draft-model", str(draft_dir)] if draft_dir else []
    proc, url = serve_tp(model_dir, tmp_path / "serve.log", *extra)
    try:
        drafted = 0
        for (prompt, k), tokens in expected.items():
            out = completion(url, prompt, k)
            assert out["choices"][0]["token_ids"] == tokens, (case, prompt, k)
            drafted += out["spec_decode"]["drafted_tokens"] if k else 0
        assert drafted > 0, "speculation ran on the requests that asked for it"
    finally:
        code = stop(proc)
    log = (tmp_path / "serve.log").read_text()
    assert "tensor-parallel rank 1/2 ready" in log
    assert code == 0, log[-3000:]


def test_torchrun_starts_the_same_group(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Under torchrun every rank runs `specserve serve`; ranks other than 0 become workers."""
    expected = reference_tokens(tiny_model_dir, None)
    port, log = free_port(), tmp_path / "torchrun.log"
    cmd = [
        str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "specserve", "serve",
        "--model", str(tiny_model_dir), "--dtype", "float32", "--port", str(port),
        "--kv-cache-gib", "0.02", "--num-threads", "1", "--tensor-parallel-size", "2",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, log)
        for prompt in PROMPTS:
            out = completion(url, prompt, 0)
            assert out["choices"][0]["token_ids"] == expected[(prompt, 0)], prompt
    finally:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on and exits 1 for a signal
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "tensor-parallel rank 1/2 ready" in text and "Finished server process" in text


def test_a_dead_rank_stops_the_server_with_a_non_zero_exit(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "serve.log"
    proc, url = serve_tp(tiny_model_dir, log, "--speculative-method", "none")
    try:
        (worker_pid,) = map(
            int, re.findall(r"tensor-parallel rank 1 \(pid (\d+)\)", log.read_text())
        )
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and not events:
                    subprocess.run(["kill", "-9", str(worker_pid)], check=True)
                events.append(line)
        data = [json.loads(e[5:]) for e in events if e.startswith("data:") and "[DONE]" not in e]
        assert data[-1]["error"]["type"] == "service_unavailable", data[-1]
        assert proc.wait(timeout=60) != 0, "a dead rank is a failure"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "tensor-parallel rank 1 exited" in log.read_text()


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
