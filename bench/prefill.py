"""Time to first token of one prompt on the bundled GGUF target, prompt chunks as the engine
runs them (max_num_batched_tokens per forward), before and after the prefill work, and
llama.cpp's prompt eval on the same file and token ids, interleaved in one process:

    python -m bench.prefill --threads 2 --lengths 100,1000,2700 --rounds 2

`before` is the former prompt path, restored in place: the blocks dequantized to float32 and
converted to bf16 per call, then F.linear; attention over a gathered copy of the context.
`after` is the current one: native bf16 dequantization + F.linear, attention in place on
consecutive blocks.
Both share one runner and its start-up choice of the dense row count. Cells are medians, ms.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from bench.gguf_matmul import cpu_flags
from engine.kernels import gguf_ops
from engine.model import attention
from engine.model.loader import load_model
from engine.model.quant import native
from engine.model.runner import ForwardInput, ModelRunner

_TEXT = "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"


@contextlib.contextmanager
def before() -> Iterator[None]:
    """The prompt path as it was: no gguf_mm_bf16, no in-place attention."""
    saved = gguf_ops.has_prefill_ops, attention._first_of_run
    gguf_ops.has_prefill_ops = lambda: False  # type: ignore[assignment]
    attention._first_of_run = lambda span, block_size: None  # type: ignore[assignment]
    try:
        yield
    finally:
        gguf_ops.has_prefill_ops, attention._first_of_run = saved  # type: ignore[assignment]


def prompt_ids(runner: ModelRunner, length: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < length:
        ids += runner.tokenizer.encode(_TEXT + f"# {len(ids)}\n")
    return ids[:length]


def ttft_ms(runner: ModelRunner, ids: list[int], chunk: int) -> float:
    table = list(range(-(-len(ids) // runner.block_size)))
    started = time.perf_counter()
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        last = start + len(part) == len(ids)
        runner.forward([ForwardInput(part, start, table, 1 if last else 0)])
    return (time.perf_counter() - started) * 1000


def llamacpp_timer(path: str, threads: int, chunk: int) -> Callable[[list[int]], float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(
        model_path=path, n_ctx=4096, n_batch=chunk, n_ubatch=chunk, n_threads=threads,
        n_threads_batch=threads, verbose=False,
    )  # fmt: skip

    def timed(ids: list[int]) -> float:
        llm.reset()
        started = time.perf_counter()
        llm.eval(ids)
        return (time.perf_counter() - started) * 1000

    return timed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="100,1000,2700", help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paths", default="before,after,llama.cpp")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_flags()}; {args.threads} threads; load {os.getloadavg()}", file=sys.stderr)
    loaded = load_model(args.model, "auto")
    runner = ModelRunner(replace(loaded, quantization="gguf"), "cpu", "bfloat16", 16)
    lengths = [int(n) for n in args.lengths.split(",")]
    runner.allocate_kv_cache(-(-max(lengths) // runner.block_size) + 1)
    timers: dict[str, Callable[[list[int]], float]] = {}
    for name in args.paths.split(","):
        if name == "llama.cpp":
            from bench.serving.llamacpp import gguf_file

            timer = llamacpp_timer(str(gguf_file(args.model)), args.threads, args.chunk)
            if timer is not None:
                timers[name] = timer
        else:
            timers[name] = _runner_timer(runner, args.chunk, name == "before")
    print(f"dense prompt rows from {native._dense_from.get(torch.bfloat16)}", file=sys.stderr)
    warm = prompt_ids(runner, 64)
    for timer in timers.values():
        timer(warm)
    times: dict[tuple[str, int], list[float]] = {(n, m): [] for n in timers for m in lengths}
    for done in range(args.rounds):
        for length in lengths:
            ids = prompt_ids(runner, length)
            for name, timer in timers.items():
                times[name, length].append(timer(ids))
                print(
                    f"round {done + 1} {length} {name}: {times[name, length][-1]:.0f} ms",
                    file=sys.stderr,
                )
    _table(times, list(timers), lengths)
    print(f"load after: {os.getloadavg()}", file=sys.stderr)
    return 0


def _runner_timer(runner: ModelRunner, chunk: int, old: bool) -> Callable[[list[int]], float]:
    def timed(ids: list[int]) -> float:
        with before() if old else contextlib.nullcontext():
            return ttft_ms(runner, ids, chunk)

    return timed


def _table(times: dict[tuple[str, int], list[float]], names: list[str], lengths: list[int]) -> None:
    print("| path | " + " | ".join(f"{n} tokens: TTFT ms (tok/s)" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for name in names:
        cells = []
        for n in lengths:
            ms = statistics.median(times[name, n])
            cells.append(f"{ms:.0f} ({n / ms * 1000:.0f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
