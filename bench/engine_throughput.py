"""Engine decode throughput against transformers' own generate, same model, dtype and threads.

    python -m bench.engine_throughput --model bundled:qwen2.5-coder-1.5b-instruct --batch 1,8,16

Decode tokens/s counts only steps in which every request is decoding (prefill excluded), for us;
for transformers, (new tokens - 1) / (generate time - time of a 1-token generate), per batch size.
Writes a markdown table to stdout (and --out FILE).

Weight formats, one process each (so resident memory is each one's own):

    python -m bench.engine_throughput --compare-quantization auto,none --batch 1,8 --max-tokens 32

prints decode tokens/s per batch size, prefill tokens/s of a 512-token prompt, the formats the
weights run as and the process's resident memory after loading.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model.loader import load_model
from engine.sample.sampling_params import SamplingParams

PROMPT = (
    "Write a Python module that implements a thread-safe LRU cache with a time-to-live for each "
    "entry, with docstrings, type hints and a small test suite using pytest. Explain the design."
)


def log(msg: str) -> None:
    print(f"[engine-throughput] {msg}", file=sys.stderr, flush=True)


def prompts_for(tokenizer: object, batch: int) -> list[list[int]]:
    base: list[int] = tokenizer(PROMPT)["input_ids"]  # type: ignore[operator]
    return [base + tokenizer(f" Variant {i}.")["input_ids"] for i in range(batch)]  # type: ignore[operator]


def ours(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{len(prompts)}-{i}-{time.monotonic_ns()}", prompt, params)
    decode_time, decode_tokens = 0.0, 0
    while engine.has_unfinished():
        decoding = (
            all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
            and not engine.scheduler.waiting
        )
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        if decoding and engine.last_stats is not None:
            decode_time += elapsed
            decode_tokens += engine.last_stats.num_generation_tokens
    return decode_tokens / decode_time


def prefill_rate(engine: LLMEngine, num_tokens: int, repeats: int) -> float:
    """Tokens/s of one prompt of `num_tokens` (a fresh one each time: no prefix cache hits)."""
    base: list[int] = engine.tokenizer(PROMPT * 20)["input_ids"]  # type: ignore[operator]
    num_tokens = min(num_tokens, engine.max_model_len - 1, len(base))
    rates = []
    for r in range(repeats):
        prompt = [(t + r + 1) % 1000 + 100 for t in base[:1]] + base[1:num_tokens]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request(f"prefill-{r}-{time.monotonic_ns()}", prompt, params)
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        rates.append(len(prompt) / (time.perf_counter() - started))
    return statistics.median(rates)


def resident_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def quantization_run(args: argparse.Namespace, batches: list[int]) -> dict[str, object]:
    """One engine with --quantization: decode per batch size, prefill, formats, memory."""
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            num_threads=args.threads,
            max_num_seqs=max(batches),
            kv_cache_gib=args.kv_cache_gib,
            max_num_batched_tokens=512,
            speculative=SpeculativeConfig(),
        )
    )
    rss = resident_gib()
    decode = {}
    for batch in batches:
        prompts = prompts_for(engine.tokenizer, batch)
        runs = [ours(engine, prompts, args.max_tokens) for _ in range(args.repeats)]
        decode[batch] = statistics.median(runs)
        log(f"{args.quantization}: batch {batch}: {decode[batch]:.2f} tok/s")
    prefill = prefill_rate(engine, 512, args.repeats)
    log(f"{args.quantization}: prefill of 512 tokens: {prefill:.1f} tok/s")
    weights = engine.target.weights
    return {
        "quantization": args.quantization,
        "weights": weights.label,
        "weight_gib": weights.weight_bytes / 2**30,
        "rss_gib": rss,
        "decode": decode,
        "prefill": prefill,
    }


def compare_quantization(args: argparse.Namespace, argv: list[str], batches: list[int]) -> str:
    results = []
    for mode in args.compare_quantization.split(","):
        cmd = [sys.executable, "-m", "bench.engine_throughput", *argv, "--quantization", mode]
        cmd += ["--json"]
        log(f"running {mode} in its own process")
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    head = "| quantization | weights | " + " | ".join(f"batch {b} tok/s" for b in batches)
    lines = [head + " | prefill 512 tok/s | weights GiB | RSS after load GiB |"]
    lines.append("|---|---|" + "---:|" * (len(batches) + 3))
    for r in results:
        cells = " | ".join(f"{r['decode'][str(b)]:.2f}" for b in batches)
        lines.append(
            f"| {r['quantization']} | {r['weights']} | {cells} | {r['prefill']:.1f} | "
            f"{r['weight_gib']:.2f} | {r['rss_gib']:.2f} |"
        )
    return "\n".join(lines)


def transformers_generate(
    model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, pad: int
) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
        return time.perf_counter() - started

    prefill = run(1)
    full = run(max_tokens)
    return len(prompts) * (max_tokens - 1) / (full - prefill)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="bundled:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", default="1,8,16")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quantization", help="run one engine with these weights (auto, none, ...)")
    ap.add_argument("--compare-quantization", help="e.g. auto,none: one process each, one table")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25)
    ap.add_argument("--json", action="store_true", help="with --quantization: one JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    if args.compare_quantization:
        raw = sys.argv[1:] if argv is None else argv
        skip = {"--compare-quantization", "--out"}
        passed = [a for i, a in enumerate(raw) if a not in skip and raw[i - 1] not in skip]
        table = compare_quantization(args, passed, batches)
        print(table)
        if args.out:
            args.out.write_text(table + "\n")
        return 0
    if args.quantization:
        result = quantization_run(args, batches)
        print(json.dumps(result) if args.json else result)
        return 0
    log(f"loading {args.model} ({args.dtype}, {args.threads} threads)")
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            num_threads=args.threads,
            max_num_seqs=max(batches),
            speculative=SpeculativeConfig(),
        )
    )
    hf = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        weights = load_model(args.model).weights_dir
        hf = AutoModelForCausalLM.from_pretrained(
            str(weights), dtype=getattr(torch, args.dtype)
        ).eval()
    pad = engine.tokenizer.pad_token_id or 0
    rows = []
    for batch in batches:
        prompts = prompts_for(engine.tokenizer, batch)
        ours_runs, hf_runs = [], []
        for r in range(args.repeats):  # interleaved, so machine noise hits both alike
            log(f"batch {batch}: repeat {r + 1}/{args.repeats}")
            ours_runs.append(ours(engine, prompts, args.max_tokens))
            if hf is not None:
                hf_runs.append(transformers_generate(hf, prompts, args.max_tokens, pad))
        rows.append(
            (batch, statistics.median(ours_runs), statistics.median(hf_runs) if hf_runs else None)
        )
    base = rows[0][1]
    lines = [
        "| batch | specserve decode tok/s | transformers generate tok/s | specserve / transformers | specserve vs its batch 1 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for batch, ours_tps, hf_tps in rows:
        ratio = f"{ours_tps / hf_tps:.2f}x" if hf_tps else "-"
        hf_cell = f"{hf_tps:.2f}" if hf_tps else "-"
        lines.append(f"| {batch} | {ours_tps:.2f} | {hf_cell} | {ratio} | {ours_tps / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
