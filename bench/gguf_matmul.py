"""One matrix through the native GGUF kernel, per ISA variant and row count: ms and GB/s of
weights read (steadier than a whole forward on a busy host).

    python -m bench.gguf_matmul --threads 2 --rows 1,4,8,16           # 8960 x 1536 Q4_K
    python -m bench.gguf_matmul --type Q6_K --shape 1536x8960 --rows 1,8 --variants avx2

The matrix is random but well-formed blocks of the type; the kernel's cost does not depend on
the values. torch's bf16 F.linear on the same matrix is printed beside it for scale.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import gguf_ops

_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_int8",
    "amx_bf16",
)


def cpu_flags() -> str:
    """The CPU's model name and the flags the kernels care about, from /proc/cpuinfo."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return "unknown CPU"
    lines = path.read_text().splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = set(next((ln for ln in lines if ln.startswith("flags")), ":").split(":", 1)[1].split())
    return f"{model} [{' '.join(f for f in _FLAGS if f in flags)}]"


def random_matrix(qtype: gguf.GGMLQuantizationType, n: int, k: int) -> torch.Tensor:
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    offset = 208 if qtype == gguf.GGMLQuantizationType.Q6_K else 0
    raw[:, :, offset : offset + 2] = np.array([1e-3], np.float16).view(np.uint8)  # finite scales
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        raw[:, :, 2:4] = np.array([1e-3], np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--type", default="Q4_K")
    ap.add_argument("--shape", default="8960x1536", help="N x K (out x in)")
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="", help="comma-separated; default: every one here")
    args = ap.parse_args(argv)
    if not gguf_ops.available():
        print("native kernels unavailable", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    qtype = gguf.GGMLQuantizationType[args.type]
    n, k = (int(v) for v in args.shape.split("x"))
    blocks = random_matrix(qtype, n, k)
    dense = gguf_ops.dequantize(blocks, int(qtype)).to(torch.bfloat16)
    rows = [int(m) for m in args.rows.split(",")]
    print(
        f"CPU: {cpu_flags()}; {args.threads} threads; {args.type} {n}x{k}, {blocks.numel() / 1e6:.2f} MB"
    )
    print("| kernel | " + " | ".join(f"M = {m}: ms (GB/s)" for m in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for variant in args.variants.split(",") if args.variants else gguf_ops.variants():
        cells = []
        for m in rows:
            x = torch.randn(m, k)
            ms = median_ms(
                lambda x=x, v=variant: gguf_ops.mm(x, blocks, int(qtype), v), args.repeats
            )
            cells.append(f"{ms:.3f} ({blocks.numel() / ms / 1e6:.1f})")
        print(f"| gguf {variant} | " + " | ".join(cells) + " |")
    cells = []
    for m in rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        ms = median_ms(lambda x=x: F.linear(x, dense), args.repeats)
        cells.append(f"{ms:.3f} ({dense.numel() * 2 / ms / 1e6:.1f})")
    print("| torch bf16 F.linear | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
