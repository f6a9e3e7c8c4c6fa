"""What the n-gram proposer's lookups cost a step: the per-request index against a scan of the text.

    python -m bench.ngram_lookup --requests 16 --prompt-tokens 300,1000 --steps 64

Each step looks every request up twice (the planner asks how many drafts a match gives, then the
proposer proposes them) and then appends 1-4 accepted tokens to each text, as a decode does.
Prints the median step's milliseconds for both, and what building the index on the prompts cost.
The heap is frozen first, as `specserve serve` freezes it after loading: otherwise the index's
new tuples set off a full collection of everything torch's import left (~150-200 ms here).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from engine.spec_decode.proposers.ngram import NgramIndex


def scan(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The lookup the index replaced (and its reference in the tests): scan right to left for the
    most recent earlier occurrence of the longest suffix n-gram, propose what followed it."""
    length = len(token_ids)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = token_ids[length - n :]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", default="300,1000", help="min,max prompt length")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2000, help="token ids drawn from [0, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gc.collect()
    gc.freeze()
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    rng = random.Random(args.seed)
    texts = [
        [rng.randrange(args.vocab) for _ in range(rng.randint(lo, hi))]
        for _ in range(args.requests)
    ]
    indexes = [NgramIndex(2, 4) for _ in texts]
    scan_s, index_s = [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        for text in texts:
            for _ in range(2):
                scan(text, 3, 2, 4)
        scan_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        for text, index in zip(texts, indexes, strict=True):
            for _ in range(2):
                index.lookup(text, 3)
        index_s.append(time.perf_counter() - started)
        for text in texts:
            text.extend(rng.randrange(args.vocab) for _ in range(rng.randint(1, 4)))
    print(
        f"{args.requests} requests, prompts of {lo}-{hi} tokens, one step: "
        f"scan {1000 * statistics.median(scan_s):.2f} ms, index {1000 * statistics.median(index_s[1:]):.3f} ms "
        f"(building the index on the prompts, in the first step: {1000 * index_s[0]:.1f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
