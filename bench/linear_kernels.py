"""One linear layer on each CPU kernel, by activation rows M: the cost a verify row adds.

Synthetic N(0, 0.02) weights of one shape (default: Qwen2.5-1.5B's fused gate/up, 8960 x 1536),
enough copies that each call reads its weights from DRAM as a decode step does, kernels
interleaved call by call so that the host's load hits all alike. The w8a8 kernels include their
own activation rounding:

    python -m bench.linear_kernels --threads 2 --ms 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from engine.model.quant.formats import quantize_int4, quantize_int8
from engine.model.quant.kernels import (
    Int4CpuKernel,
    Int8DynamicFastKernel,
    Int8DynamicKernel,
    Int8Kernel,
    Kernel,
)

CPU = torch.device("cpu")


def kernels(n: int, k: int, copies: int) -> dict[str, list[Kernel]]:
    weights = [torch.randn(n, k) * 0.02 for _ in range(copies)]
    int8 = [quantize_int8(w) for w in weights]
    return {
        "w8a8 (two passes)": [Int8DynamicKernel(q, CPU) for q in int8],
        "w8a8-fast (one pass)": [Int8DynamicFastKernel(q, CPU) for q in int8],
        "int8 weight-only": [Int8Kernel(q, CPU) for q in int8],
        "int4 g32": [Int4CpuKernel(quantize_int4(w, 32), CPU) for w in weights],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ms", default="1,2,4,8,16", help="activation rows")
    ap.add_argument("--shape", default="8960,1536", help="N,K")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per kernel and M")
    ap.add_argument("--copies", type=int, default=8, help="weight copies cycled through")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split(","))
    print(f"packing {args.copies} copies of a {n}x{k} weight per kernel", file=sys.stderr)
    kinds = kernels(n, k, args.copies)
    ms = [int(m) for m in args.ms.split(",")]
    print("| M | " + " | ".join(f"{name} µs" for name in kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    for m in ms:
        x = torch.randn(m, k).to(torch.bfloat16)
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for call in range(args.calls + 3):
            for name, copies in kinds.items():
                started = time.perf_counter()
                copies[call % len(copies)](x)
                if call >= 3:  # the first calls warm up
                    times[name].append(time.perf_counter() - started)
        cells = [f"{statistics.median(t) * 1e6:,.0f}" for t in times.values()]
        print(f"| {m} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
