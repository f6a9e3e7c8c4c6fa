"""One forward of the model at M new tokens, bf16 weights against quantized ones, same process.

Both runners read the same GGUF file (the bf16 one dequantizes its blocks at load, so no bf16
conversion is needed) and alternate, so the host's load hits both alike:

    python -m bench.quant_forward --threads 1 --rows 1,2,3,4,5,8 --prefill 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from engine.loader import load_model
from engine.model_runner import ForwardInput, ModelRunner

_CACHED = 64  # tokens already in the KV cache when the measured rows are computed


def forward_ms(runner: ModelRunner, rows: int, repeats: int) -> float:
    ids = [(1000 + i) % runner.vocab_size for i in range(rows)]
    table = list(range(-(-(_CACHED + rows) // runner.block_size)))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.forward([ForwardInput(ids, _CACHED, table, rows)])
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def prefill_rate(runner: ModelRunner, tokens: int) -> float:
    ids = [(1000 + i) % runner.vocab_size for i in range(tokens)]
    started = time.perf_counter()
    runner.forward([ForwardInput(ids, 0, list(range(-(-tokens // runner.block_size))), 1)])
    return tokens / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct", help="a .gguf model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,8", help="M: new tokens per forward")
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens (0: skip)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    quantized = load_model(args.model, "auto")
    runners = {
        "bf16": ModelRunner(replace(quantized, quantization="none"), "cpu", "bfloat16", 16),
        "auto": ModelRunner(quantized, "cpu", "bfloat16", 16),
    }
    blocks = -(-max(_CACHED + max(rows), args.prefill) // 16) + 1
    for runner in runners.values():
        runner.allocate_kv_cache(blocks)
        forward_ms(runner, 8, 1)  # warm-up
    print("| weights | " + " | ".join(f"M = {m} ms" for m in rows) + " | prefill tok/s |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for name, runner in runners.items():
        cells = [f"{forward_ms(runner, m, args.repeats):.0f}" for m in rows]
        prefill = f"{prefill_rate(runner, args.prefill):.1f}" if args.prefill else "-"
        print(f"| {name} ({runner.weights.label}) | " + " | ".join(cells) + f" | {prefill} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
