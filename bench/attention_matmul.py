"""A decode step of many requests with the short-query attention's matmuls in bf16 against float32.

On a CPU without native bf16 dot products (AVX2) the engine runs those matmuls in float32
(`engine/model/attention.py`). This times a whole target forward both ways in one process, rounds
interleaved, for batches of decodes (one row each) and of verifies (k + 1 rows each) at a given
context, the shape of a loaded server's steps:

    python -m bench.attention_matmul --threads 2 --requests 16 --context 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.model import attention
from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner


def batch(requests: int, rows: int, context: int, block_size: int) -> list[ForwardInput]:
    per = -(-(context + rows) // block_size)
    ids = [1000 + j for j in range(rows)]
    return [
        ForwardInput(ids, context, list(range(i * per, (i + 1) * per)), rows)
        for i in range(requests)
    ]


def timed(runner: ModelRunner, inputs: list[ForwardInput], float32: bool) -> float:
    native = attention._cpu_has_half_matmul
    attention._cpu_has_half_matmul = lambda: not float32  # type: ignore[assignment]
    try:
        started = time.perf_counter()
        runner.forward(inputs)
        return time.perf_counter() - started
    finally:
        attention._cpu_has_half_matmul = native


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--quantization", default="w8a8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rows", default="1,2,4", help="rows per request: 1 = decode, k + 1 = verify")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if attention._cpu_has_half_matmul():
        print("note: this CPU has native bf16; the engine keeps bf16 matmuls here", file=sys.stderr)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, args.quantization)
    runner = ModelRunner(loaded, "cpu", "bfloat16", 16)
    rows = [int(r) for r in args.rows.split(",")]
    per = -(-(args.context + max(rows)) // runner.block_size)
    runner.allocate_kv_cache(args.requests * per + 1)
    times: dict[tuple[int, bool], list[float]] = {(r, f): [] for r in rows for f in (False, True)}
    for done in range(args.rounds):
        print(f"round {done + 1}/{args.rounds}", file=sys.stderr)
        for r in rows:
            inputs = batch(args.requests, r, args.context, runner.block_size)
            for float32 in (False, True) if done % 2 == 0 else (True, False):
                timed(runner, inputs, float32)  # warm-up of this shape
                times[r, float32].append(timed(runner, inputs, float32))
    print(f"{args.requests} requests at {args.context} tokens of context, {runner.weights.label}")
    print("| rows per request | bf16 matmuls ms | float32 matmuls ms | speed-up |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        bf16, f32 = (statistics.median(times[r, f]) * 1000 for f in (False, True))
        print(f"| {r} | {bf16:.0f} | {f32:.0f} | {bf16 / f32:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
