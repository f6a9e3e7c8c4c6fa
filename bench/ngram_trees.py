"""Draft trees against chains (n-gram, an EAGLE-3 head's with --eagle3, the draft model's with
--draft), in one engine, c = 1.

    python -m bench.ngram_trees --categories code,chat --num-prompts 3 --max-tokens 96 \\
        --k 6 --tree-width 3 --rounds 2
    python -m bench.ngram_trees --draft --categories code,chat --num-prompts 2 --max-tokens 64 \\
        --k 4 --tree-width 2,3 --rounds 1

One engine (configs/ngram.yaml's target, fixed k, no planner) decodes every prompt greedily in
three modes, in an order that reverses every round: `plain` (no drafts), `chain` (the latest
match's continuation, k drafts) and `tree` (up to `--tree-width` matches merged into a tree of at
most k nodes, engine/spec_decode/proposers/tree.py; several widths, `2,3`: a tree mode for each).
Each prompt is put in the prefix cache first. Reports
each mode's output tokens per second (median over rounds), the ratios, the mean accepted length
per verify pass, and whether every mode's text equals plain's (greedy: it must, up to rounding
near ties: a later branch's rows sum their softmax in other SIMD lanes than plain decoding's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.engine_args import cpu_flags
from bench.serving.datasets import load_category
from bench.serving.options import csv_list
from bench.spec_grid import token_ids
from engine.core.llm_engine import LLMEngine
from engine.model.runner import ForwardInput
from engine.sample.sampling_params import SamplingParams

BASE_MODES = ("plain", "chain")
# A tree of 6 nodes for --verify-cost: two branches of 3 at the root (a chain's 6 rows otherwise).
COST_TREE = (-1, 0, 1, -1, 3, 4)


def modes(widths: list[int]) -> list[str]:
    """plain, chain, then a tree mode per width ("tree" alone for one width)."""
    trees = ["tree"] if len(widths) == 1 else [f"tree{w}" for w in widths]
    return [*BASE_MODES, *trees]


def mode_width(mode: str, widths: list[int]) -> int:
    if not mode.startswith("tree"):
        return 1
    return widths[0] if mode == "tree" else int(mode.removeprefix("tree"))


def run_mode(
    engine: LLMEngine, mode: str, prompts: list[list[int]], k: int, width: int, max_tokens: int
) -> tuple[float, list[list[int]], int, int]:
    """tokens/s, the outputs, verify passes with drafts and tokens accepted, one prompt at a time.
    `width`: the mode's tree width (1: chains)."""
    for proposer in (engine._ngram, engine._eagle3, engine.proposer):  # whichever drafts
        if proposer is not None and hasattr(proposer, "tree_width"):
            proposer.tree_width = width
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=0 if mode == "plain" else k
    )
    outputs, tokens, passes, accepted, started = [], 0, 0, 0, time.perf_counter()
    for prompt in prompts:
        (seq,) = engine.generate([prompt], params)
        outputs.append(seq.output_token_ids)
        tokens += seq.num_output_tokens
        passes += seq.spec.num_drafts
        accepted += seq.spec.num_accepted_tokens
    return tokens / (time.perf_counter() - started), outputs, passes, accepted


def verify_cost(engine: LLMEngine, prompt: list[int], rounds: int) -> dict[str, float]:
    """Median seconds of one target forward after the prompt: a decode (1 row), a chain verify
    (1 + 6 rows) and a tree verify of the same rows (COST_TREE), alternating, on scratch blocks
    past the prompt's (nothing is kept)."""
    target, n = engine.target, len(prompt)
    pool, need = engine.block_manager.num_blocks, -(-(n + 8) // engine.config.block_size)
    table = list(range(pool - need, pool))  # the pool's last blocks: no request reaches them here
    target.forward([ForwardInput(prompt[:-1], 0, table, 0)])
    drafts = prompt[:6]
    shapes = {
        "decode": ForwardInput([prompt[-1]], n - 1, table, 1),
        "chain": ForwardInput([prompt[-1], *drafts], n - 1, table, 7, 6),
        "tree": ForwardInput([prompt[-1], *drafts], n - 1, table, 7, 6, COST_TREE),
    }
    seconds: dict[str, list[float]] = {name: [] for name in shapes}
    for _ in range(rounds):
        for name, inp in shapes.items():
            started = time.perf_counter()
            target.forward([inp])
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/ngram.yaml"))
    ap.add_argument(
        "--eagle3", default=None, help="an EAGLE-3 head's folder: its trees against its chains"
    )
    ap.add_argument("--categories", default="code,chat")
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--draft", action="store_true", help="the config's draft model's trees")
    ap.add_argument("--tree-width", default="3", help="one width, or several: 2,3")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--verify-cost", type=int, default=0, help="only time decode/chain/tree forwards, N rounds"
    )
    args = ap.parse_args(argv)

    from server.settings import Settings

    widths = [int(w) for w in csv_list(args.tree_width)]
    config = Settings.load(args.config).engine_config()
    spec = replace(
        config.speculative,
        num_speculative_tokens=args.k,
        adaptive=False,
        tree_width=max(widths),
    )
    if args.eagle3 is not None:
        spec = replace(spec, method="eagle3", draft_model=args.eagle3)
    if args.draft:  # the draft model alone (no n-gram matches), e.g. configs/pair.yaml's
        spec = replace(spec, method="draft", draft_p_min=0.0)
    engine = LLMEngine(replace(config, speculative=spec))
    print(f"CPU: {cpu_flags()}; threads {engine.config.num_threads}", flush=True)
    for category in csv_list(args.categories):
        prompts = [token_ids(engine, p) for p in load_category(category, args.num_prompts, {})]
        if args.verify_cost:
            cost = verify_cost(engine, prompts[0], args.verify_cost)
            print(f"{category}: forward medians (s) {cost}; tree / chain x"
                  f"{cost['tree'] / cost['chain']:.3f}, chain / decode x"
                  f"{cost['chain'] / cost['decode']:.3f}", flush=True)  # fmt: skip
            continue
        engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))  # prefix cache
        names = modes(widths)
        rates: dict[str, list[float]] = {m: [] for m in names}
        texts: dict[str, list[list[int]]] = {}
        counts: dict[str, tuple[int, int]] = {}
        for r in range(args.rounds):
            for mode in names if r % 2 == 0 else names[::-1]:
                width = mode_width(mode, widths)
                rate, out, passes, accepted = run_mode(
                    engine, mode, prompts, args.k, width, args.max_tokens
                )
                rates[mode].append(rate)
                print(f"  {category} round {r} {mode}: {rate:.2f} tok/s", flush=True)
                texts[mode] = out
                counts[mode] = (passes, accepted)
        med = {m: statistics.median(v) for m, v in rates.items()}
        print(f"\n{category}: tok/s (median of {args.rounds} rounds), k={args.k}")
        for mode in names:
            passes, accepted = counts[mode]
            length = 1 + accepted / passes if passes else 1.0
            same = sum(a == b for a, b in zip(texts[mode], texts["plain"], strict=True))
            print(
                f"  {mode:6s} {med[mode]:6.2f} tok/s  x{med[mode] / med['plain']:.3f} plain"
                f"  accepted length/pass {length:.2f}  equal to plain {same}/{len(prompts)}"
                f"  rounds {[round(x, 2) for x in rates[mode]]}"
            )
        for mode in names[len(BASE_MODES) :]:
            print(f"  {mode} / chain: x{med[mode] / med['chain']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
