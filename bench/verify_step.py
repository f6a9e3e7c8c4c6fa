"""Micro-benchmark of one step's verification on random logits: per request vs batched.

    python -m bench.verify_step [--vocab 151936] [--k 4] [--batches 1,8,16] [--threads 1]

"per request" is the path the engine took before verification was batched (processed_probs and
verify on each request's k + 1 rows, with its syncs); "batched" is verify_batch. Drafts are random
tokens (nearly all rejected), so the times are those of the verification math, not of acceptance.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.sample.sampler import processed_probs, verification_histories
from engine.sample.sampling_params import SamplingParams
from engine.spec_decode.rejection_sampler import verify, verify_batch

CASES: list[tuple[str, SamplingParams, bool]] = [
    ("greedy, n-gram drafts", SamplingParams(temperature=0.0), False),
    ("T0.8, draft probs", SamplingParams(temperature=0.8), True),
    ("T0.8 top-p0.95, n-gram", SamplingParams(temperature=0.8, top_p=0.95), False),
    ("T0.8 top-p0.95, draft probs", SamplingParams(temperature=0.8, top_p=0.95), True),
    ("T0.8 freq-pen, draft probs", SamplingParams(temperature=0.8, frequency_penalty=0.5), True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--batches", default="1,8,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'case':30s} batch  per request ms  batched ms")
    for name, params, dense in CASES:
        for batch in (int(b) for b in args.batches.split(",")):
            per_request, batched = _runs(params, dense, batch, args.vocab, args.k)
            times = _interleaved([per_request, batched], args.reps)
            print(f"{name:30s} {batch:5d}  {times[0]:14.1f}  {times[1]:10.1f}")


def _runs(
    params: SamplingParams, dense: bool, batch: int, vocab: int, k: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    gen = torch.Generator().manual_seed(batch)
    logits = 4 * torch.randn(batch * (k + 1), vocab, generator=gen)  # [batch * (k + 1), V]
    drafts = torch.randint(0, vocab, (batch, k), generator=gen).tolist()
    q = [torch.softmax(torch.randn(k, vocab, generator=gen), -1) if dense else None] * batch
    outputs = [torch.randint(0, vocab, (200,), generator=gen).tolist() for _ in range(batch)]

    def per_request() -> None:
        for b in range(batch):
            rows = logits[b * (k + 1) : (b + 1) * (k + 1)]  # [k + 1, V]
            history = verification_histories(outputs[b], drafts[b])
            probs = processed_probs(rows, [params] * (k + 1), history)
            verify(probs, drafts[b], q[b], params.greedy, None)

    def batched() -> None:
        verify_batch(logits, drafts, q, [params] * batch, outputs, [None] * batch)

    return per_request, batched


def _interleaved(runs: list[Callable[[], None]], reps: int) -> list[float]:
    """Best ms of each run after a warm-up, alternating their order so both see the same load."""
    times: list[list[float]] = [[] for _ in runs]
    for rep in range(reps + 1):
        order = list(range(len(runs)))[:: 1 if rep % 2 else -1]
        for i in order:
            start = time.perf_counter()
            runs[i]()
            if rep:
                times[i].append(1000 * (time.perf_counter() - start))
    return [min(t) for t in times]


if __name__ == "__main__":
    main()
