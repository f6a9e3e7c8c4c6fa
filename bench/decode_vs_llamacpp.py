"""Plain decode tok/s of one GGUF file in specserve's engine and in llama.cpp, in one process run,
alternating rounds: the same prompt token ids, greedy, the same number of new tokens, the same
threads, one request at a time.

specserve: `LLMEngine` on the file (quantization auto: its blocks on the native kernels, dtype
bfloat16, as `specserve serve --model bundled:NAME`), no speculation. llama.cpp: llama-cpp-python's
`Llama` (built from source for this CPU by `make llamacpp`) on the same file. A round times each
engine's decode of each prompt, the two back to back in alternating order: tokens after the
first over the time since the first. The report is each side's median and the median of the
pairs' ratios (on a shared host the pairs see the same load).

    python -m bench.decode_vs_llamacpp --model bundled:gemma-3-270m --rounds 3 --max-tokens 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.engine_args import cpu_flags
from bench.serving.llamacpp import gguf_file

PROMPTS = (
    "The history of the printing press begins",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Three tips for writing readable code:\n1.",
    "The capital of France is Paris. The capital of Germany is",
)


def specserve_engine(model: str, threads: int) -> Any:
    from engine.config import EngineConfig, SpeculativeConfig
    from engine.core.llm_engine import LLMEngine

    config = EngineConfig(model=model, num_threads=threads, max_model_len=4096,
                          speculative=SpeculativeConfig())  # fmt: skip
    return LLMEngine(config)


def specserve_rate(engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    from engine.sample.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    stamps: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids:
                stamps.append(time.perf_counter())
                tokens += out.new_token_ids
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), tokens


def llamacpp_rate(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    llm.reset()
    stamps: list[float] = []
    tokens: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return (len(tokens) - 1) / (stamps[-1] - stamps[0]), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bundled:gemma-3-270m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    import torch
    from llama_cpp import Llama

    torch.set_num_threads(args.threads)
    path = gguf_file(args.model)
    engine = specserve_engine(args.model, args.threads)
    tokenizer = engine.tokenizer
    llm = Llama(str(path), n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                verbose=False)  # fmt: skip
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    specserve_rate(engine, prompts[0], 8)  # warm-up: first forwards, the kernels' caches
    llamacpp_rate(llm, prompts[0], 8)
    ours: list[float] = []
    theirs: list[float] = []
    same = 0
    for r in range(args.rounds):
        for i, p in enumerate(prompts):  # pairs, in alternating order: the host's load hits both
            first_ours = (r + i) % 2 == 0
            b = llamacpp_rate(llm, p, args.max_tokens) if not first_ours else None
            a = specserve_rate(engine, p, args.max_tokens)
            b = b or llamacpp_rate(llm, p, args.max_tokens)
            ours.append(a[0])
            theirs.append(b[0])
            same += a[1] == b[1]
            print(f"round {r} prompt {i}: specserve {a[0]:.1f} tok/s, llama.cpp {b[0]:.1f} tok/s",
                  flush=True)  # fmt: skip
    mo, mt = statistics.median(ours), statistics.median(theirs)
    ratio = statistics.median(x / y for x, y in zip(ours, theirs, strict=True))
    print(f"model {path.name}, {args.max_tokens} tokens x {len(prompts)} prompts x "
          f"{args.rounds} rounds, {args.threads} threads; cpu {cpu_flags()}")  # fmt: skip
    print(f"identical greedy continuations: {same}/{len(ours)}")
    print(f"median decode: specserve {mo:.1f} tok/s, llama.cpp {mt:.1f} tok/s; "
          f"median of the pairs' ratios {ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
