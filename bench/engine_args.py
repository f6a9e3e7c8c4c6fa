"""What the in-process benchmarks share: the engine's settings as flags, the CPU they ran on, and
when an engine's requests are all past their prompts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine

BUNDLED_TARGET = "bundled:qwen2.5-coder-1.5b-instruct"
# The SIMD flags the kernels choose by, as /proc/cpuinfo names them.
FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)


def add_engine_args(
    ap: argparse.ArgumentParser, quantization: str = "auto", kv_cache_gib: float = 2.0
) -> None:
    """The settings every in-process benchmark's engine takes (no speculation unless its own);
    `auto` is the engine's own fastest path for the weights on this CPU, as the server's."""
    ap.add_argument("--model", default=BUNDLED_TARGET)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=quantization)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kv-cache-gib", type=float, default=kv_cache_gib)


def decoding(engine: LLMEngine) -> bool:
    """Every request of the engine is past its prompt (none waits, none has a chunk left)."""
    s = engine.scheduler
    return not s.waiting and all(seq.num_uncomputed_tokens <= 1 for seq in s.running)


def cpu_flags() -> str:
    """The CPU model and the SIMD flags the kernels care about."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    lines = info.splitlines()
    model = next((ln.split(":", 1)[1].strip() for ln in lines if "model name" in ln), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
    return f"{model}; {' '.join(f for f in FLAGS if f in flags)}"
