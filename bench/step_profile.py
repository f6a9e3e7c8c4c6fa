"""Where one engine step's time goes, and what attention alone costs at long contexts.

    python -m bench.step_profile --batch 1 --context 2700           # one decode step, by kind
    python -m bench.step_profile --attention-only                   # kernel vs gathered path
    python -m bench.step_profile --attention-only --isas avx512bf16,amx   # kernel variants, cold
    python -m bench.step_profile --quantization gguf --bandwidth --context 100 --steps 15
        # decode steps against the memory bandwidth bound, measured in turn

The step profile builds the engine (no speculation), prefills `--batch` requests of `--context`
random tokens, then profiles `--steps` decode steps with torch.profiler and splits their time
into GEMMs (every matrix product outside attention), attention (everything under the attention
call: KV writes, gathers or the native kernel, softmax), other ops (norms, RoPE, activations,
sampling...) and host time (the step's wall time no op accounts for: Python, scheduling).

The attention-only run times one layer's short-query attention with the bundled target's shapes
(12 query heads, 2 KV heads of 128, bfloat16, blocks of 16) at batch 1 for contexts of 100 to
8,000 tokens: the native kernel against the gathered path it replaces, with one layer's K/V in
cache ("hot"), and the native kernel over 28 layers' own K/V after 64 MB of other reads, as in a
decode step where the weights stream through the caches between layers ("cold", per step).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.profiler_util import FunctionEvent

from bench.engine_args import cpu_flags, decoding
from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.kernels import attention_ops
from engine.model import attention, decoder
from engine.model.attention import AttentionMetadata, RequestSpan
from engine.model.quant.native import GgufKernel
from engine.sample.sampling_params import SamplingParams

ATTENTION_RANGE = "step_profile.attention"
GEMM = re.compile(r"mm|linear|matmul|quantized::|fbgemm|int4pack|int8pack|gemm", re.IGNORECASE)


# ---------------------------------------------------------------------------- one engine step


def engine_for(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=args.model, dtype=args.dtype, quantization=args.quantization,
            num_threads=args.threads, max_num_seqs=max(args.batch, 1), kv_cache_gib=args.kv_cache_gib,
            max_model_len=args.context + args.steps + 64, speculative=SpeculativeConfig(),
        )
    )  # fmt: skip


def start_decoding(engine: LLMEngine, batch: int, context: int, steps: int) -> None:
    """Admit `batch` requests of `context` random tokens and step until all of them decode."""
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for b in range(batch):
        prompt = [rng.randrange(3, min(20000, engine.target.vocab_size)) for _ in range(context)]
        engine.add_request(f"profile-{b}", prompt, params)
    while not decoding(engine):
        engine.step()


def with_attention_range(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.profiler.record_function(ATTENTION_RANGE):
            return fn(*args, **kwargs)

    return wrapped


def kind_of(event: FunctionEvent) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == ATTENTION_RANGE:
            return "attention"
        parent = parent.cpu_parent
    return "GEMMs" if GEMM.search(event.name) else "other ops"


def profile_steps(engine: LLMEngine, steps: int) -> tuple[float, dict[str, float]]:
    """(wall ms per step, ms per step by kind)."""
    decoder.paged_attention = with_attention_range(attention.paged_attention)  # type: ignore[attr-defined]
    decoder.attend = with_attention_range(attention.attend)  # type: ignore[attr-defined]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            wall = (time.perf_counter() - started) * 1e3 / steps
    finally:
        decoder.paged_attention = attention.paged_attention  # type: ignore[attr-defined]
        decoder.attend = attention.attend  # type: ignore[attr-defined]
    kinds = {"GEMMs": 0.0, "attention": 0.0, "other ops": 0.0}
    for event in prof.events():
        if event.name != ATTENTION_RANGE and event.device_type.name == "CPU":
            kinds[kind_of(event)] += event.self_cpu_time_total / 1e3 / steps
    kinds["host"] = max(0.0, wall - sum(kinds.values()))
    return wall, kinds


def step_report(args: argparse.Namespace) -> None:
    engine = engine_for(args)
    start_decoding(engine, args.batch, args.context, args.steps)
    for _ in range(2):  # warm
        engine.step()
    wall, kinds = profile_steps(engine, args.steps)
    native = "native kernel" if attention_ops.available() else "gathered path"
    print(f"CPU: {cpu_flags()}; {args.threads} threads")
    print(f"{args.model} {args.quantization}, batch {args.batch}, context {args.context}: "
          f"{wall:.1f} ms a decode step (profiled; attention: {native})")  # fmt: skip
    for kind, ms in kinds.items():
        print(f"  {kind:10s} {ms:7.1f} ms  {100 * ms / wall:5.1f}%")


# ---------------------------------------------------------------------------- attention alone


def attention_case(context: int, rows: int = 1, block_size: int = 16) -> tuple[torch.Tensor, ...]:
    blocks = -(-context // block_size) + 1
    shape = (2, blocks, block_size, 128)
    k_cache = torch.randn(shape).to(torch.bfloat16)
    v_cache = torch.randn(shape).to(torch.bfloat16)
    q = torch.randn(rows, 12, 128).to(torch.bfloat16)
    return q, k_cache, v_cache


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times)  # best of `repeats`: the machine may be shared


def attention_report(args: argparse.Namespace) -> None:
    if not attention_ops.available():
        raise SystemExit("the native kernels are not built (python -m engine.kernels.build)")
    print(f"CPU: {cpu_flags()}; {args.threads} threads")
    print("one layer, batch 1 decode, 12 heads / 2 KV heads x 128, bfloat16, blocks of 16")
    print("| context | gathered ms, hot | native ms, hot | speedup | native, 28 layers cold |")
    print("|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        gathered, native = attention_at(context, args.repeats)
        cold = cold_step_ms(context, args.repeats)["auto"]
        print(f"| {context} | {gathered:.3f} | {native:.3f} | {gathered / native:.1f}x | "
              f"{cold:.1f} ms |")  # fmt: skip


def attention_at(context: int, repeats: int) -> tuple[float, float]:
    """(gathered ms, native ms) of one layer's decode attention at this context."""
    q, k_cache, v_cache = attention_case(context)
    table = list(range(-(-context // 16)))
    group = AttentionMetadata.build([RequestSpan(context - 1, 1, table)], 16, q.device).groups[0]
    scale = 128**-0.5
    gathered = time_ms(lambda: gathered_attention(q, k_cache, v_cache, group, scale), repeats)
    native = time_ms(
        lambda: attention._native_attention(q, k_cache, v_cache, group, scale), repeats
    )
    return gathered, native


def cold_step_ms(
    context: int, repeats: int, isas: tuple[str, ...] = ("auto",), rows: int = 1, layers: int = 28
) -> dict[str, float]:
    """Median ms of one decode step's attention per kernel variant (interleaved): `layers`
    layers, each with its own K/V, after 64 MB of other reads (a decode step streams the weights
    through the caches between layers). `rows` > 1: a verify query of that many tokens."""
    cases = [attention_case(context, rows) for _ in range(layers)]
    table = list(range(-(-context // 16)))
    span = RequestSpan(context - rows, rows, table)
    group = AttentionMetadata.build([span], 16, cases[0][0].device).groups[0]
    assert group.start_pos is not None and group.query_lens is not None
    other = torch.ones(16 << 20)
    times: dict[str, list[float]] = {isa: [] for isa in isas}
    for _ in range(repeats):
        for isa in isas:
            other.sum()
            started = time.perf_counter()
            for q, k_cache, v_cache in cases:
                attention_ops.paged_attention(
                    q, k_cache, v_cache, group.block_tables, group.start_pos, group.query_lens,
                    128**-0.5, isa=isa,
                )  # fmt: skip
            times[isa].append((time.perf_counter() - started) * 1e3)
    return {isa: statistics.median(t) for isa, t in times.items()}


def isa_report(args: argparse.Namespace) -> None:
    """The cold step per kernel variant, interleaved in one process, ratios to the first."""
    if not attention_ops.available():
        raise SystemExit("the native kernels are not built (python -m engine.kernels.build)")
    isas = tuple(args.isas.split(","))
    print(f"CPU: {cpu_flags()}; {args.threads} threads")
    print(f"28 layers' attention, cold, {args.verify_rows} query token(s), 12 heads / 2 KV heads "
          "x 128, bfloat16, blocks of 16; ms (ratio to the first variant)")  # fmt: skip
    print("| context | " + " | ".join(isas) + " |")
    print("|---:|" + "---:|" * len(isas))
    for context in args.contexts:
        ms = cold_step_ms(context, args.repeats, isas, args.verify_rows)
        first = ms[isas[0]]
        print(
            f"| {context} | "
            + " | ".join(f"{ms[i]:.2f} ({ms[i] / first:.2f})" for i in isas)
            + " |"
        )


def gathered_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       group: attention.AttentionGroup, scale: float) -> torch.Tensor:  # fmt: skip
    qg = attention._pad_queries(q, group)
    keys = attention._gather(k_cache, group.block_tables)
    values = attention._gather(v_cache, group.block_tables)
    return attention._short_attention(qg, keys, values, group.mask, scale)


# ---------------------------------------------------------------------------- the bandwidth bound


def read_gbs(buf: torch.Tensor, repeats: int = 5) -> float:
    """GB/s a reduction reads from `buf`, far larger than the caches (../shared/tools/membw.py's
    measure: the best of a sum and a max, median of `repeats`)."""
    best = 0.0
    for op in (torch.sum, torch.amax):
        op(buf)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            op(buf)
            times.append(time.perf_counter() - started)
        best = max(best, buf.numel() * buf.element_size() / statistics.median(times) / 1e9)
    return best


def streamed_bytes(engine: LLMEngine) -> int:
    """Bytes of weights a decode step reads: every native GGUF matrix (the head's too; the
    embedding table is only looked up)."""
    kernels = []
    for module in engine.target.model.modules():
        kernels += list(getattr(module, "kernels", None) or [])
        kernels += [getattr(module, "head", None)]
    return sum(k.blocks.numel() for k in kernels if isinstance(k, GgufKernel))


def bandwidth_report(args: argparse.Namespace) -> None:
    """Decode steps against the memory bandwidth bound, measured in turn: each round reads
    1 GiB by a reduction before and after `--steps` decode steps, and the share is the bound's
    step time (the weights' bytes at that bandwidth) over the median step."""
    engine = engine_for(args)
    start_decoding(engine, args.batch, args.context, args.steps * args.rounds + 8)
    buf = torch.ones(2**30 // 4)
    nbytes = streamed_bytes(engine)
    print(f"CPU: {cpu_flags()}; {args.threads} threads")
    print(f"{args.model} {args.quantization}, batch {args.batch}, context {args.context}: "
          f"{nbytes / 1e9:.3f} GB of weights a step")  # fmt: skip
    print("| round | GB/s read | bound ms | step ms | share of the bound |")
    print("|---:|---:|---:|---:|---:|")
    shares = []
    for r in range(args.rounds):
        before = read_gbs(buf)
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - started) * 1e3)
        gbs = (before + read_gbs(buf)) / 2
        bound, step = nbytes / gbs / 1e6, statistics.median(times)
        shares.append(bound / step)
        print(f"| {r + 1} | {gbs:.1f} | {bound:.1f} | {step:.1f} | {100 * bound / step:.0f}% |")
    print(f"median share: {100 * statistics.median(shares):.0f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default="w8a8")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--attention-only", action="store_true")
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 1000, 2700, 8000])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument(
        "--isas",
        help="with --attention-only: compare these kernel variants, e.g. "
        "avx512bf16,amx (names as attention_ops.paged_attention's isa)",
    )
    ap.add_argument("--verify-rows", type=int, default=1, help="with --isas: query tokens")
    ap.add_argument(
        "--bandwidth",
        action="store_true",
        help="decode steps against the memory bandwidth bound (--rounds of --steps steps)",
    )
    ap.add_argument("--rounds", type=int, default=6, help="with --bandwidth")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        if args.bandwidth:
            bandwidth_report(args)
        elif args.attention_only:
            isa_report(args) if args.isas else attention_report(args)
        else:
            step_report(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
