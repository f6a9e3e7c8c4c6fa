"""Acceptance of seeded requests (sample-and-match) against unseeded ones (rejection sampling).

    python -m bench.seeded_acceptance --categories code,chat --num-prompts 4 --max-tokens 64 \\
        --temperature 0.7 --k 3 --seeds 2

One engine (the launch config's models and quantization, draft-model speculation at a fixed k:
no planner, no early stop, so every step verifies k drafts for both kinds) answers the bench's
prompts at a temperature, once per seed with that seed and as often without one. An unseeded
request accepts draft x with probability min(1, p(x) / q(x)); a seeded one accepts it only
where it equals the target's own Gumbel-max token, which the draft shares the noise of
(docs/SAMPLING.md). The table gives both acceptance rates (accepted over verified drafts) and
their ratio: what a seed costs in accepted tokens per step. The last column checks the promise:
how many seeded answers equal the same seed's answer with speculation off for the request.
`--noise-cost 151936` only times one row of seeded noise against its alternatives.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from bench.serving.datasets import load_category
from bench.serving.options import csv_list
from bench.spec_grid import token_ids
from engine.core.llm_engine import LLMEngine
from engine.sample.sampler import exponential
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import SeedStream, exponential_at


@dataclass(frozen=True)
class Acceptance:
    drafted: int
    accepted: int
    emitted: int

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


@dataclass(frozen=True)
class Comparison:
    unseeded: Acceptance
    seeded: Acceptance
    same_text: int  # seeded answers identical to the same seed's answer without speculation
    answers: int  # seeded answers compared


def measure(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[Acceptance, list[list[int]]]:
    """Run the prompts together: the drafts they verified and accepted, and their answers."""
    seqs = engine.generate(prompts, params)
    acceptance = Acceptance(
        drafted=sum(s.spec.num_draft_tokens for s in seqs),
        accepted=sum(s.spec.num_accepted_tokens for s in seqs),
        emitted=sum(s.num_output_tokens for s in seqs),
    )
    return acceptance, [s.output_token_ids for s in seqs]


def compare(
    engine: LLMEngine,
    prompts: list[list[int]],
    temperature: float,
    max_tokens: int,
    seeds: list[int],
) -> Comparison:
    """Per seed: the prompts unseeded, seeded, and seeded without speculation (the reference a
    seeded answer must equal)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    unseeded, seeded, same = [], [], 0
    for seed in seeds:
        unseeded.append(measure(engine, prompts, params)[0])
        with_seed = replace(params, seed=seed)
        acceptance, answers = measure(engine, prompts, with_seed)
        seeded.append(acceptance)
        _, plain = measure(engine, prompts, replace(with_seed, num_speculative_tokens=0))
        same += sum(a == b for a, b in zip(answers, plain, strict=True))
    return Comparison(_total(unseeded), _total(seeded), same, len(seeds) * len(prompts))


def _total(parts: list[Acceptance]) -> Acceptance:
    return Acceptance(
        sum(p.drafted for p in parts), sum(p.accepted for p in parts), sum(p.emitted for p in parts)
    )


def noise_cost(vocab_size: int, repeats: int = 15) -> dict[str, float]:
    """Milliseconds (median) to draw one row of Exp(1) noise: the counter noise seeded rows use,
    a torch.Generator seeded per row (the alternative), and the default RNG (unseeded rows)."""
    cpu = torch.device("cpu")
    keys = SeedStream.of(3, 0).row_keys(0, 1)

    def per_row_generator() -> None:
        exponential((vocab_size,), torch.Generator().manual_seed(keys[0] >> 1), cpu)

    candidates = {
        "counter noise": lambda: exponential_at(keys, vocab_size, cpu),
        "torch.Generator per row": per_row_generator,
        "default RNG": lambda: exponential((1, vocab_size), None, cpu),
    }
    return {name: _median_ms(draw, repeats) for name, draw in candidates.items()}


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/pair.yaml"))
    ap.add_argument("--categories", default="code,chat")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt (0, 1, ...)")
    ap.add_argument("--noise-cost", type=int, metavar="VOCAB", help="only time a row of noise")
    ap.add_argument("--kv-cache-gib", type=float, default=0.25, help="a few prompts need little")
    args = ap.parse_args(argv)
    if args.noise_cost:
        torch.set_num_threads(1)
        for name, ms in noise_cost(args.noise_cost).items():
            print(f"{name}: {ms:.2f} ms per row of {args.noise_cost:,}")
        return 0

    from server.settings import Settings

    settings = Settings.load(
        args.config,
        speculative_method="draft",
        num_speculative_tokens=args.k,
        speculative_adaptive=False,
        draft_p_min=0.0,
        draft_compile=False,  # acceptance does not depend on it; start-up does
        kv_cache_gib=args.kv_cache_gib,
    )
    engine = LLMEngine(settings.engine_config())
    print(
        "| category | tokens (unseeded / seeded) | unseeded acceptance | seeded acceptance "
        "| ratio | seeded = no speculation |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for category in csv_list(args.categories):
        prompts = [token_ids(engine, p) for p in load_category(category, args.num_prompts, {})]
        print(f"seeded_acceptance: {category}: {len(prompts)} prompts", file=sys.stderr)
        c = compare(engine, prompts, args.temperature, args.max_tokens, list(range(args.seeds)))
        print(
            f"| {category} | {c.unseeded.emitted} / {c.seeded.emitted} | {c.unseeded.rate:.3f} | "
            f"{c.seeded.rate:.3f} | {c.seeded.rate / c.unseeded.rate:.2f} | "
            f"{c.same_text} / {c.answers} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
