"""Matrices through the native GGUF kernel, per ISA variant, layout and row count: median ms,
GB/s of weights read and the cost of M rows over one row (steadier than a whole forward on a
busy host). Every kernel of a case is timed in turn inside each repeat (interleaved), so a
change in the host's load hits them alike.

    python -m bench.gguf_matmul --threads 2                     # Q4_K and Q6_K 8960 x 1536, lm_head
    python -m bench.gguf_matmul --cases Q4_K:8960x1536 --rows 1,8 --variants avx2
    python -m bench.gguf_matmul --cases MXFP4:2880x2880,Q8_0:2880x2880,Q4_0:2880x2880 \
        --rows 1,8 --int8-rows                                  # gpt-oss's experts' width

`--layouts tiles,rows16` sets the layouts compared: "tiles" the per-row ones (Q4_K_X for
avx512vnni), "rows16" 16 weight rows interleaved (Q4_K_R16, Q6_K_R16, ...). The matrix is random
but well-formed blocks of the type; the kernel's cost does not depend on the values. torch's bf16
F.linear on the same matrix is printed beside it for scale (matrices up to 2^25 values).
`--int8-rows` adds the matrix dequantized and rounded to int8 per row on aten's int8 kernel
(bf16 activations): how `quantization: gguf` ran a format without a native kernel (MXFP4 before
it had one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import gguf_ops
from engine.model.quant.formats import quantize_int8
from engine.model.quant.kernels import Kernel, make_kernel

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
    if qtype == gguf.GGMLQuantizationType.MXFP4:
        raw[:, :, 0] = 118  # E8M0: 2^-10
        return torch.from_numpy(raw.reshape(n, -1))
    offset = 208 if qtype == gguf.GGMLQuantizationType.Q6_K else 0
    raw[:, :, offset : offset + 2] = np.array([1e-3], np.float16).view(np.uint8)  # finite scales
    if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
        raw[:, :, 2:4] = np.array([1e-3], np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def timed_ms(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def interleaved_medians(kernels: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each kernel, all of them run once per repeat in turn (after one warm run)."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for fn in kernels.values():
        fn()
    for _ in range(repeats):
        for name, fn in kernels.items():
            times[name].append(timed_ms(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def case_kernels(
    qtype: gguf.GGMLQuantizationType, blocks: torch.Tensor, variants: list[str], layouts: list[str]
) -> dict[str, tuple[torch.Tensor, int, str]]:
    """label -> (packed blocks, type id, variant) for each variant x layout that differs."""
    out: dict[str, tuple[torch.Tensor, int, str]] = {}
    for variant in variants:
        for layout in layouts:
            packed, packed_type = gguf_ops.pack(blocks, int(qtype), variant, layout)
            if layout == "rows16" and packed_type == int(qtype):
                continue  # no interleaved layout for this type
            if layout == "rows16" and variant not in ("avx512vnni", "avxvnni", "avx2", "scalar"):
                continue  # no kernel for it in this variant
            if packed_type == gguf_ops.Q8_0_R16 and variant == "avx2":
                continue  # plain AVX2 multiplies Q8_0 per row (its values overflow vpmaddubsw)
            out[f"{variant} {layout}"] = (packed, packed_type, variant)
    return out


def int8_rows_kernel(blocks: torch.Tensor, qtype: int) -> Kernel:
    """The matrix dequantized, rounded to int8 per row and given the kernel a bf16 model's
    `gguf` load picked for such rows (aten's int8 GEMM where it passes its self-test)."""
    weight = quantize_int8(gguf_ops.dequantize(blocks, qtype))
    return make_kernel(weight, torch.bfloat16, torch.device("cpu"))


def run_case(
    case: str,
    rows: list[int],
    variants: list[str],
    layouts: list[str],
    repeats: int,
    int8_rows: bool = False,
) -> None:
    name, shape = case.split(":")
    qtype = gguf.GGMLQuantizationType[name]
    n, k = (int(v) for v in shape.split("x"))
    blocks = random_matrix(qtype, n, k)
    megabytes = blocks.numel() / 1e6
    kernels = case_kernels(qtype, blocks, variants, layouts)
    calls: dict[str, Callable[[], object]] = {}
    inputs = {m: torch.randn(m, k) for m in rows}
    for label, (packed, packed_type, variant) in kernels.items():
        for m in rows:
            calls[f"{label}|{m}"] = partial(gguf_ops.mm, inputs[m], packed, packed_type, variant)
    if int8_rows:
        kernel = int8_rows_kernel(blocks, int(qtype))
        for m in rows:
            calls[f"int8 rows ({kernel.name})|{m}"] = partial(kernel, inputs[m])
    if n * k <= 1 << 25:
        dense = gguf_ops.dequantize(blocks, int(qtype)).to(torch.bfloat16)
        for m in rows:
            calls[f"torch bf16 F.linear|{m}"] = partial(F.linear, inputs[m].bfloat16(), dense)
    medians = interleaved_medians(calls, repeats)
    print(f"\n{name} {n}x{k}, {megabytes:.2f} MB")
    print("| kernel | " + " | ".join(f"M = {m}: ms" for m in rows) + " | GB/s at M = 1 |")
    print("|---|" + "---:|" * (len(rows) + 1))
    for label in dict.fromkeys(key.split("|")[0] for key in calls):
        one = medians[f"{label}|{rows[0]}"]
        cells = [
            f"{medians[f'{label}|{m}']:.3f} ({medians[f'{label}|{m}'] / one:.2f}x)" for m in rows
        ]
        print(f"| {label} | " + " | ".join(cells) + f" | {megabytes / one:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--cases",
        default="Q4_K:8960x1536,Q6_K:8960x1536,Q6_K:151936x1536",
        help="TYPE:NxK (out x in), comma-separated",
    )
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="", help="comma-separated; default: every SIMD one here")
    ap.add_argument("--layouts", default="tiles,rows16")
    ap.add_argument(
        "--int8-rows", action="store_true", help="also the int8-row kernel on the same values"
    )
    args = ap.parse_args(argv)
    if not gguf_ops.available():
        print("native kernels unavailable", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    variants = (
        args.variants.split(",")
        if args.variants
        else [v for v in gguf_ops.variants() if v != "scalar"]
    )
    rows = [int(m) for m in args.rows.split(",")]
    print(
        f"CPU: {cpu_flags()}; {args.threads} threads; load average {os.getloadavg()[0]:.2f} "
        f"(1 min) at start; medians of {args.repeats}, (x) = ms / ms at M = {rows[0]}"
    )
    for case in args.cases.split(","):
        run_case(case, rows, variants, args.layouts.split(","), args.repeats, args.int8_rows)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
