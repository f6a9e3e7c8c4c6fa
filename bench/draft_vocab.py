"""How much of the target's answers a draft head limited to the first N token ids can propose.

    python -m bench.draft_vocab --categories code,chat,summarization --num-prompts 4 \\
        --sizes 16384,32768,65536,98304 --max-tokens 64

The target answers the bench's prompts plainly (greedy, the launch config's models and
quantization, no draft loaded); each cell is the share of answer tokens whose id is below the
size or is a stop id (`draft_vocab_size` keeps both). Every token outside it is one the draft
cannot propose, so the share is a ceiling on what the limit leaves of acceptance, per position.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.serving.datasets import load_category
from bench.serving.options import csv_list
from bench.spec_grid import token_ids
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams


def coverage(tokens: list[int], size: int, stops: frozenset[int]) -> float:
    return sum(t < size or t in stops for t in tokens) / max(len(tokens), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/default.yaml"))
    ap.add_argument("--categories", default="code,chat,summarization")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--sizes", default="16384,32768,65536,98304")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    from server.settings import Settings

    engine = LLMEngine(Settings.load(args.config, speculative_method="none").engine_config())
    sizes = [int(s) for s in csv_list(args.sizes)]
    print("| category | answer tokens | " + " | ".join(f"first {s:,}" for s in sizes) + " |")
    print("|---|---:|" + "---:|" * len(sizes))
    for category in csv_list(args.categories):
        prompts = [token_ids(engine, p) for p in load_category(category, args.num_prompts, {})]
        print(
            f"draft_vocab: {category}: the target answers {len(prompts)} prompts", file=sys.stderr
        )
        seqs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
        tokens = [t for seq in seqs for t in seq.output_token_ids]
        cells = " | ".join(f"{coverage(tokens, s, engine.eos_token_ids):.1%}" for s in sizes)
        print(f"| {category} | {len(tokens)} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
