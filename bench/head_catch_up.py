"""What a long prompt costs the EAGLE-3 head's first drafting step, in one process, c = 1.

    python -m bench.head_catch_up --config configs/default.yaml --prompt-tokens 2048 --shared 1536

The head drafts from the target's features of every position before the last, so before its
first draft it runs over the prompt (its catch-up). Two cases, each timed step by step:
- `long`: one request with a prompt of --prompt-tokens, prefilled in chunks of the config's
  max_num_batched_tokens;
- `shared`: a request whose prompt starts with --shared tokens another request just used (a long
  system prompt), served from the prefix cache, then its own tail.
For each: the time to the first token, and the slowest decode step (the head's catch-up rides in
its first drafting step) against the median one. Every other running request waits out each of
those steps. The prompts are this repository's own source text, tokenized.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.engine_args import cpu_flags
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams

SOURCES = (
    "engine/model/runner.py",
    "engine/spec_decode/planner.py",
    "engine/core/block_manager.py",
)


def source_ids(engine: LLMEngine, num_tokens: int, skip: int = 0) -> list[int]:
    """`num_tokens` tokens of the repository's source text, from token `skip` on."""
    text = "\n".join(Path(p).read_text() for p in SOURCES)
    ids = engine.tokenizer(text)["input_ids"]
    assert len(ids) >= skip + num_tokens, f"only {len(ids)} tokens of source text"
    return list(ids[skip : skip + num_tokens])


def timed_request(engine: LLMEngine, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """Step one request to its end: its first token's time, its slowest decode step (where the
    head's first draft, and so its catch-up, falls) and its median decode step, in ms."""
    engine.add_request(f"catch-up-{time.monotonic_ns()}", prompt, _greedy(max_tokens))
    seq = next(reversed(engine.seqs.values()))
    started, steps = time.perf_counter(), []
    first_token, prefill_steps = None, 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0) * 1000)
        if first_token is None and seq.num_output_tokens:
            first_token = (time.perf_counter() - started) * 1000
            prefill_steps = len(steps)
    decode = steps[prefill_steps:]
    return {
        "first token": first_token or 0.0,
        "slowest decode step": max(decode),
        "median decode step": statistics.median(decode),
    }


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--shared", type=int, default=1536, help="the shared case's cached prefix")
    ap.add_argument("--tail", type=int, default=64, help="the shared case's own tokens")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    from server.settings import Settings

    engine = LLMEngine(Settings.load(args.config).engine_config())
    print(f"CPU: {cpu_flags()}; threads {torch.get_num_threads()}", flush=True)
    print(f"chunks of {engine.config.max_num_batched_tokens} tokens", flush=True)
    results: dict[str, list[dict[str, float]]] = {"long": [], "shared": []}
    for r in range(args.rounds):
        # a different stretch of text each round: no prefix-cache hit across rounds
        offset = r * (args.prompt_tokens + args.shared + 2 * args.tail)
        long = source_ids(engine, args.prompt_tokens, offset)
        results["long"].append(timed_request(engine, long, args.max_tokens))
        system = source_ids(engine, args.shared + 2 * args.tail, offset + args.prompt_tokens)
        first, second = system[: args.shared + args.tail], system[: args.shared]
        second += system[args.shared + args.tail :]
        engine.generate([first], _greedy(args.max_tokens))  # puts the shared prefix in the cache
        results["shared"].append(timed_request(engine, second, args.max_tokens))
    for case, runs in results.items():
        print(f"{case}:", flush=True)
        for key in runs[0]:
            values = [run[key] for run in runs]
            print(f"  {key}: {statistics.median(values):.0f} ms "
                  f"({', '.join(f'{v:.0f}' for v in values)})", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
