"""What the server costs: batch-1 decode of the engine alone against the same engine behind HTTP.

    python -m bench.server_gap --model bundled:qwen2.5-coder-1.5b-instruct --quantization w8a8

Both sides use the same settings (model, dtype, weights, threads, KV pool, no speculation) and
the same prompt. The engine alone is stepped on this process's main thread (as
`bench.engine_throughput` does); the server is `specserve serve` in a process of its own,
streamed one request at a time. Decode tok/s is (tokens - 1) / (last token - first token) on
both sides, so prefill is left out. Prints both rates, their ratio and the CPU's flags.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.engine_args import add_engine_args, cpu_flags
from bench.serving.launcher import free_port, stop, wait_healthy
from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams

PROMPT = "def quicksort(items: list[int]) -> list[int]:\n    "


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        num_threads=args.threads, max_num_seqs=args.max_num_seqs, kv_cache_gib=args.kv_cache_gib,
        speculative=SpeculativeConfig(),
    )  # fmt: skip


def serve_args(args: argparse.Namespace, port: int) -> list[str]:
    return [
        sys.executable, "-m", "specserve", "serve", "--model", args.model,
        "--dtype", args.dtype, "--quantization", args.quantization,
        "--num-threads", str(args.threads), "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-gib", str(args.kv_cache_gib), "--speculative-method", "none",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip


def decode_rate(stamps: list[float]) -> float:
    """Tokens/s after the first token, from the times each token arrived."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def engine_alone(args: argparse.Namespace) -> tuple[list[float], list[int]]:
    """Decode rates of the engine stepped on this thread, and the prompt's token ids."""
    engine = LLMEngine(engine_config(args))
    prompt: list[int] = engine.tokenizer(PROMPT)["input_ids"]  # type: ignore[operator]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rates = []
    for r in range(args.repeats + 1):  # the first run warms up
        engine.add_request(f"alone-{r}", prompt, params)
        stamps: list[float] = []
        while engine.has_unfinished():
            for out in engine.step():
                stamps += [time.perf_counter()] * len(out.new_token_ids)
        if r:
            rates.append(decode_rate(stamps))
    return rates, prompt


def through_server(args: argparse.Namespace, prompt: list[int]) -> list[float]:
    import subprocess

    port = free_port()
    log_path = Path(args.log)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(serve_args(args, port), stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(f"{url}/health", proc, log_path, timeout_s=1800)
            return [streamed_rate(url, prompt, args.max_tokens) for _ in range(args.repeats + 1)][
                1:
            ]
        finally:
            stop(proc)


def streamed_rate(url: str, prompt: list[int], max_tokens: int) -> float:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True,
    }  # fmt: skip
    stamps: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    return decode_rate(stamps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log", default="/tmp/specserve-server-gap.log", help="the server's log")
    args = ap.parse_args(argv)
    alone, prompt = engine_alone(args)
    print(f"engine alone: {_fmt(alone)} tok/s; now through the server", file=sys.stderr)
    gc.collect()  # the engine alone is gone before the server loads its own copy
    served = through_server(args, prompt)
    ratio = statistics.median(served) / statistics.median(alone)
    print(f"CPU: {cpu_flags()}; {args.threads} threads; {args.model} {args.quantization}")
    print(f"engine alone, batch 1:  {statistics.median(alone):6.2f} tok/s  runs {_fmt(alone)}")
    print(f"through the server:     {statistics.median(served):6.2f} tok/s  runs {_fmt(served)}")
    print(f"server / engine alone:  {ratio:.2f}x")
    return 0


def _fmt(rates: list[float]) -> str:
    return " ".join(f"{r:.2f}" for r in rates)


if __name__ == "__main__":
    raise SystemExit(main())
