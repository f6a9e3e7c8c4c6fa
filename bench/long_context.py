"""Long contexts: time to first token and decode speed with prompts of ~100 to 8,000 tokens,
specserve's engine against llama.cpp on the same GGUF file, and many requests at once.

    python -m bench.long_context --threads 2 --contexts 100 1000 2700 8000
    python -m bench.long_context --threads 2 --contexts 100 2700 --peer none --quantization w8a8

The prompt is Python source (this repository's engine/ package) cut to N tokens with the
target's tokenizer: a raw completion, greedy, --max-tokens new tokens, no speculation. specserve
runs in this process, stepped on this thread; llama.cpp (llama-cpp-python, the `llamacpp` extra)
runs after it in the same process, on the same file and threads, its prompt evaluated in batches
of 512. Time to first token is the prompt's wall time; decode tok/s is (tokens - 1) / (last token
- first token), the median of --repeats decodes from the same evaluated prompt (specserve: the
prompt again, a prefix-cache hit; llama.cpp: its state saved after the prompt and restored). The batch row runs --batch requests of the first context >= 1,000 at once and
reports their aggregate decode tok/s while all of them decode, against one request's. Prints the
CPU's flags.

Decode at a long context against decode at the first is a ratio of two figures taken minutes
apart, and a shared host's load moves in minutes. `--paired` measures it again with the load
shared: a second engine decodes the first context while this one decodes each longer one, a
step of each in turn, and the ratio is the median over pairs of the two steps' times.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.engine_args import add_engine_args, cpu_flags, decoding
from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams

SOURCE = Path(__file__).resolve().parent.parent / "engine"


@dataclass(frozen=True)
class Run:
    ttft_s: float
    decode_tok_s: float


def source_tokens(tokenizer: object, n: int) -> list[int]:
    """n tokens of Python source, the same ids for both engines."""
    text = "\n\n".join(p.read_text() for p in sorted(SOURCE.rglob("*.py")))
    ids: list[int] = tokenizer(text)["input_ids"]  # type: ignore[operator]
    if len(ids) < n:
        ids = ids * (n // len(ids) + 1)
    return ids[:n]


def decode_rate(stamps: list[float]) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def all_decoding_rate(stamps: list[list[float]]) -> float:
    """Aggregate tokens/s while every request decodes: from the last first token to the first
    last token (before, some requests still prefill; after, some are done)."""
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    if end <= start:
        raise SystemExit("the requests never all decoded at once: raise --max-tokens")
    tokens = sum(1 for s in stamps for t in s if start < t <= end)
    return tokens / (end - start)


def specserve_runs(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> list[tuple[float, list[float]]]:
    """(time to first token, token stamps) of requests submitted together."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    stamps: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{started}", prompt, params)
        stamps[f"r{i}-{started}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            stamps[out.request_id] += [time.perf_counter()] * len(out.new_token_ids)
    return [(s[0] - started, s) for s in stamps.values()]


def specserve_table(
    args: argparse.Namespace,
) -> tuple[dict[int, Run], float | None, list[list[int]], LLMEngine]:
    config = EngineConfig(
        model=args.model, dtype=args.dtype, quantization=args.quantization,
        num_threads=args.threads, max_num_seqs=max(16, args.batch),
        kv_cache_gib=args.kv_cache_gib, speculative=SpeculativeConfig(),
    )  # fmt: skip
    engine = LLMEngine(config)
    prompts = [source_tokens(engine.tokenizer, n) for n in args.contexts]
    specserve_runs(engine, [prompts[0][:64]], 8)  # warm up
    table = {}
    for n, prompt in zip(args.contexts, prompts, strict=True):
        print(f"specserve: {n}-token prompt", file=sys.stderr)
        ((ttft, stamps),) = specserve_runs(engine, [prompt], args.max_tokens)
        rates = [decode_rate(stamps)]
        for _ in range(args.repeats - 1):  # the prompt again: a prefix-cache hit, decode alone
            ((_, stamps),) = specserve_runs(engine, [prompt], args.max_tokens)
            rates.append(decode_rate(stamps))
        table[n] = Run(ttft, statistics.median(rates))
    batch_ratio = None
    long = next((n for n in args.contexts if n >= 1000), None)
    if args.batch > 1 and long is not None:
        print(f"specserve: {args.batch} requests at {long} tokens at once", file=sys.stderr)
        base = prompts[args.contexts.index(long)]
        # distinct prompts (no prefix-cache sharing): each request's first token differs
        batch = [[(t + i) % 1000 + 10 for t in base[:1]] + base[1:] for i in range(args.batch)]
        runs = specserve_runs(engine, batch, args.max_tokens)
        aggregate = all_decoding_rate([s for _, s in runs])
        batch_ratio = aggregate / table[long].decode_tok_s
        print(f"  aggregate {aggregate:.1f} tok/s", file=sys.stderr)
    return table, batch_ratio, prompts, engine


def paired_ratios(
    args: argparse.Namespace, engine: LLMEngine, prompts: list[list[int]]
) -> dict[int, tuple[float, float, float]]:
    """Per longer context: (median, first quartile, third quartile) of the first context's
    step time over its own, decode steps of the two alternating (the first context on an engine
    of its own; `engine` holds the longer prompts in its prefix cache)."""
    config = engine.config
    short = LLMEngine(config)
    pairs = args.max_tokens
    params = SamplingParams(max_tokens=pairs * len(prompts) + 8, temperature=0.0, ignore_eos=True)
    short.add_request("paired-short", prompts[0], params)
    ratios = {}
    for n, prompt in zip(args.contexts[1:], prompts[1:], strict=True):
        print(f"specserve: {n} tokens paired with {args.contexts[0]}", file=sys.stderr)
        engine.add_request(f"paired-{n}", prompt, SamplingParams(
            max_tokens=pairs + 8, temperature=0.0, ignore_eos=True))  # fmt: skip
        while not all(decoding(e) for e in (short, engine)):  # prompts in first
            for e in (short, engine):
                if not decoding(e):
                    e.step()
        ratio = [timed_step(short) / timed_step(engine) for _ in range(pairs)]
        engine.abort(f"paired-{n}")
        q1, median, q3 = statistics.quantiles(ratio, n=4)
        ratios[n] = (median, q1, q3)
    short.abort("paired-short")
    return ratios


def timed_step(engine: LLMEngine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def llamacpp_table(args: argparse.Namespace, prompts: list[list[int]]) -> dict[int, Run]:
    from llama_cpp import Llama

    from bench.serving.llamacpp import gguf_file

    llm = Llama(
        model_path=str(gguf_file(args.model)), n_ctx=max(args.contexts) + args.max_tokens + 16,
        n_threads=args.threads, n_threads_batch=args.threads, n_batch=512, verbose=False,
    )  # fmt: skip
    llm.eval(prompts[0][:64])  # warm up: the file's pages, the thread pool
    table = {}
    for n, prompt in zip(args.contexts, prompts, strict=True):
        print(f"llama.cpp: {n}-token prompt", file=sys.stderr)
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        state = llm.save_state() if args.repeats > 1 else None
        stamps = llamacpp_decode(llm, args.max_tokens)
        ttft, rates = stamps[0] - started, [decode_rate(stamps)]
        for _ in range(args.repeats - 1):  # back to the evaluated prompt, decode again
            llm.load_state(state)
            rates.append(decode_rate(llamacpp_decode(llm, args.max_tokens)))
        table[n] = Run(ttft, statistics.median(rates))
    return table


def llamacpp_decode(llm: Any, max_tokens: int) -> list[float]:
    """Greedy tokens after the evaluated prompt: the stamp of each."""
    stamps = []
    for _ in range(max_tokens):
        token = llm.sample(temp=0.0, repeat_penalty=1.0)
        stamps.append(time.perf_counter())
        llm.eval([token])
    return stamps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(ap, quantization="gguf", kv_cache_gib=1.0)
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 1000, 2700, 8000])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="requests at once (1: skip)")
    ap.add_argument("--peer", choices=["llamacpp", "none"], default="llamacpp")
    ap.add_argument(
        "--paired", action="store_true",
        help="also measure each context's decode against the first's with steps alternating",
    )  # fmt: skip
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="decode each context this many times (the prompt's cache kept) and report the median",
    )  # fmt: skip
    args = ap.parse_args(argv)
    ours, batch_ratio, prompts, engine = specserve_table(args)
    paired = paired_ratios(args, engine, prompts) if args.paired else {}
    del engine
    gc.collect()
    theirs = llamacpp_table(args, prompts) if args.peer == "llamacpp" else {}
    print(f"CPU: {cpu_flags()}; {args.threads} threads; {args.model} ({args.quantization})")
    print("| prompt tokens | TTFT s | llama.cpp TTFT s | decode tok/s | llama.cpp tok/s |"
          " decode / decode at the first |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    first = ours[args.contexts[0]].decode_tok_s
    for n in args.contexts:
        run, peer = ours[n], theirs.get(n)
        print(
            f"| {n} | {run.ttft_s:.2f} | {peer.ttft_s if peer else float('nan'):.2f} "
            f"| {run.decode_tok_s:.2f} | {peer.decode_tok_s if peer else float('nan'):.2f} "
            f"| {run.decode_tok_s / first:.2f} |"
        )
    for n, (median, q1, q3) in paired.items():
        print(
            f"decode at {n} / decode at {args.contexts[0]}, steps paired: {median:.3f} "
            f"(quartiles {q1:.3f}-{q3:.3f})"
        )
    if batch_ratio is not None:
        print(f"{args.batch} requests at once: aggregate decode {batch_ratio:.1f}x one request's")
    if theirs:
        ratios = [ours[n].decode_tok_s / theirs[n].decode_tok_s for n in args.contexts]
        print(f"decode vs llama.cpp, median over contexts: {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
