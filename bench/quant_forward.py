"""One forward of the model at M new tokens, one runner per quantization, same process.

Every runner reads the same GGUF file (`none` dequantizes its blocks at load, so no bf16
conversion is needed). Rounds alternate the runners, so the host's load hits all alike; cells are
medians over rounds:

    python -m bench.quant_forward --threads 1 --rows 1,2,3,4,5,8 --prefill 512
    python -m bench.quant_forward --threads 2 --modes auto,w8a8,w8a8-fast --rows 1,2,4,8,16
    python -m bench.quant_forward --threads 2 --modes gguf,w8a8,auto --rows 1,2,4,8,16 --prefill 512
    python -m bench.quant_forward --threads 2 --modes gguf --gguf-layouts tiles,rows16 \
        --rows 1,2,4,8,16 --prefill 0   # the kernels' per-row and 16-row-interleaved layouts
    python -m bench.quant_forward --model bundled:qwen2.5-coder-0.5b-instruct --modes w8a8-fast \
        --head-rows 0,32768,65536 --rows 1,2 --prefill 0   # a draft's limited head
    python -m bench.quant_forward --model bundled:qwen2.5-coder-0.5b-instruct --modes w8a8-fast \
        --head-rows 65536 --compile 0,1 --rows 1,2,4 --prefill 0   # eager against compiled
    python -m bench.quant_forward --modes gguf --stack 0,1 --rows 1,4 --prefill 0 \
        --rounds 5   # the Python layer loop against the native stack (decoder_stack)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

import torch

from bench.gguf_matmul import cpu_flags
from engine.model.loader import load_model
from engine.model.quant import native
from engine.model.runner import ForwardInput, ModelRunner

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
    ap.add_argument("--repeats", type=int, default=3, help="forwards per cell and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="none,auto", help="quantizations to compare")
    ap.add_argument(
        "--head-rows",
        default="0",
        help="draft_vocab_size values to compare, one runner each (0: the whole vocabulary)",
    )
    ap.add_argument(
        "--compile",
        default="0",
        help="0 (eager layers), 1 (DecodeGraph: one request's decode compiled), or both: 0,1",
    )
    ap.add_argument(
        "--stack",
        default="1",
        help="1 (decode and verify through the native layer stack where it applies), 0 (the "
        "Python layer loop), or both: 0,1",
    )
    ap.add_argument(
        "--gguf-layouts",
        default="",
        help="for mode gguf: weight layouts to compare, one runner each (tiles, rows16; '': best)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_flags()}; {args.threads} threads", file=sys.stderr)
    rows = [int(m) for m in args.rows.split(",")]
    loaded = load_model(args.model, "auto")
    runners = {}
    for mode in args.modes.split(","):
        for layout in args.gguf_layouts.split(",") if mode == "gguf" else [""]:
            native.pack_layout = layout  # read as the runner's layers load
            for head in (int(h) for h in args.head_rows.split(",")):
                for compiled in (c == "1" for c in args.compile.split(",")):
                    for stack in (c == "1" for c in args.stack.split(",")):
                        name = (
                            mode
                            + (f" {layout}" if layout else "")
                            + (f", head {head}" if head else "")
                            + (", compiled" if compiled else "")
                            + ("" if stack else ", Python loop")
                        )
                        runner = ModelRunner(
                            replace(loaded, quantization=mode), "cpu", "bfloat16", 16,
                            head or None, compiled,
                        )  # fmt: skip
                        if not stack:
                            runner.model.native_stack = None
                        runners[name] = runner
    native.pack_layout = ""
    blocks = -(-max(_CACHED + max(rows), args.prefill) // 16) + 1
    for runner in runners.values():
        runner.allocate_kv_cache(blocks)
        runner.warm_up()  # compiles a DecodeGraph (minutes the first time; cached)
        forward_ms(runner, 8, 1)  # warm-up of caches and allocators
    times: dict[tuple[str, int], list[float]] = {(name, m): [] for name in runners for m in rows}
    for done in range(args.rounds):
        print(f"round {done + 1}/{args.rounds}", file=sys.stderr)
        for m in rows:
            for name, runner in runners.items():
                times[name, m].append(forward_ms(runner, m, args.repeats))
    print("| weights | " + " | ".join(f"M = {m} ms" for m in rows) + " | prefill tok/s |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for name, runner in runners.items():
        cells = [f"{statistics.median(times[name, m]):.0f}" for m in rows]
        prefill = f"{prefill_rate(runner, args.prefill):.1f}" if args.prefill else "-"
        print(f"| {name} ({runner.weights.label}) | " + " | ".join(cells) + f" | {prefill} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
