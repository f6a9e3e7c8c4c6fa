"""An EAGLE-3 head against plain decoding and the config's own speculation, in one process, c = 1.

    python -m bench.eagle3_head --head heads/qwen2.5-coder-1.5b-eagle3 --categories code,chat \\
        --num-prompts 6 --max-tokens 96 --rounds 2

Two engines on the same target (the launch config's models, quantization and threads): the
config's (its speculation, e.g. the 0.5B draft with n-gram lookups) and the same config with
`speculative_method: hybrid-eagle3` and the head. Modes, in an order that reverses every round:
`plain` (no drafts), `config` (the config's speculation, adaptive), `hybrid-eagle3` (an n-gram
match where the planner prices it higher, else the head), `eagle3` (the head alone, adaptive),
`eagle3 k=K` (the head alone drafting K every step, no planner: its raw acceptance) and, for each
`--tree-widths` W, `hybrid-eagle3 tree w=W` (the head's EAGLE-2 trees of width W). Prompts are the
bench's held-out ones (`load_category(..., seed 0)`, never trained on: tools/eagle3_data.py) and
each is put in both engines' prefix caches first. Greedy, so every mode must emit plain's tokens;
the report says whether they did.

Reports per category each mode's output tokens per second (median over rounds) and its ratio to
plain, tokens per verify pass, the head's acceptance by draft position (of the fixed-k mode), and
the head's and the target's one-row forward times (the cost ratio that decides break-even), and
the head's forward over `--catch-up-rows` rows (its first draft after a prompt of that length).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from bench.engine_args import cpu_flags
from bench.quant_forward import forward_ms
from bench.serving.datasets import load_category
from bench.serving.options import csv_list
from bench.spec_grid import token_ids
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.proposers.forced import ForcedDraftProposer


@dataclass(frozen=True)
class Mode:
    name: str
    engine: LLMEngine
    k: int | None  # None: the config's k ceiling, the planner on; else fixed k, no planner
    head_alone: bool = False  # the hybrid-eagle3 engine's head without its n-gram proposer
    tree_width: int = 1  # the head's draft trees (EAGLE-2) where > 1, priced so by the planner


@dataclass
class Tally:
    rates: list[float] = field(default_factory=list)
    passes: int = 0
    tokens: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def add(self, seqs: list[Sequence], seconds: float) -> None:
        self.rates.append(sum(s.num_output_tokens for s in seqs) / seconds)
        self.outputs = [list(s.output_token_ids) for s in seqs]
        for s in seqs:
            self.passes += s.spec.num_drafts
            self.tokens += s.spec.num_accepted_tokens + s.spec.num_drafts
            _add(self.drafted_per_pos, s.spec.drafted_per_pos)
            _add(self.accepted_per_pos, s.spec.accepted_per_pos)


def _add(into: list[int], more: list[int]) -> None:
    into.extend([0] * (len(more) - len(into)))
    for i, n in enumerate(more):
        into[i] += n


def run(mode: Mode, prompts: list[list[int]], max_tokens: int) -> tuple[list[Sequence], float]:
    """One prompt at a time (c = 1), each mode's planner or fixed k."""
    engine = mode.engine
    saved = engine.planner, engine.proposer, engine._ngram
    if mode.k is not None:
        engine.planner = engine.scheduler.planner = None
    if mode.head_alone:
        assert engine._eagle3 is not None
        engine.proposer, engine._ngram = ForcedDraftProposer(engine._eagle3), None
    _set_tree_width(engine, mode.tree_width)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=mode.k)
    seqs, started = [], time.perf_counter()
    try:
        for prompt in prompts:
            seqs += engine.generate([prompt], params)
    finally:
        engine.planner, engine.proposer, engine._ngram = saved
        engine.scheduler.planner = engine.planner
        _set_tree_width(engine, 1)
    return seqs, time.perf_counter() - started


def _set_tree_width(engine: LLMEngine, width: int) -> None:
    """The head's trees and the planner's price of them, as `speculative_tree_width` sets both."""
    if engine._eagle3 is not None:
        engine._eagle3.tree_width = width
    if engine.planner is not None:
        engine.planner.tree_width = width


def step_ms(engine: LLMEngine, rounds: int = 5) -> tuple[float, float]:
    """Median one-row forward of the target (after 64 cached tokens, bench.quant_forward's) and
    of the head (catch-up of one row and its logits), ms."""
    assert engine._eagle3 is not None
    head = engine._eagle3.calibrate([1], rounds)[0][1]
    return forward_ms(engine.target, 1, rounds), head * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/pair.yaml"))
    ap.add_argument("--head", required=True, help="the EAGLE-3 head's folder")
    ap.add_argument("--categories", default="code,chat")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--fixed-k", type=int, default=4, help="the head's fixed-k mode (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tree-widths", type=csv_list, default=[], help="hybrid-eagle3 tree modes")
    ap.add_argument("--catch-up-rows", type=csv_list, default=[], help="head forwards to time")
    args = ap.parse_args(argv)

    from server.settings import Settings

    config = Settings.load(args.config).engine_config()
    ceiling = max(config.speculative.num_speculative_tokens, args.fixed_k)
    ours = LLMEngine(config)
    spec = replace(
        config.speculative,
        method="hybrid-eagle3",
        draft_model=args.head,
        num_speculative_tokens=ceiling,
    )
    eagle = LLMEngine(replace(config, speculative=spec))
    print(f"CPU: {cpu_flags()}; threads {torch.get_num_threads()}", flush=True)
    target_ms, head_ms = step_ms(eagle)
    print(f"one-row forward: target {target_ms:.1f} ms, head {head_ms:.2f} ms "
          f"({head_ms / target_ms:.3f} of a target step)", flush=True)  # fmt: skip
    assert eagle._eagle3 is not None
    for rows, seconds in eagle._eagle3.calibrate([int(r) for r in args.catch_up_rows], 3):
        print(f"head catch-up of {rows} rows: {seconds * 1000:.1f} ms "
              f"({seconds * 1000 / target_ms:.1f} target steps)", flush=True)  # fmt: skip
    modes = [
        Mode("plain", ours, 0),
        Mode("config", ours, None),
        Mode("hybrid-eagle3", eagle, None),
        Mode("eagle3", eagle, None, head_alone=True),
        *([Mode(f"eagle3 k={args.fixed_k}", eagle, args.fixed_k, True)] if args.fixed_k else []),
        *(
            Mode(f"hybrid-eagle3 tree w={w}", eagle, None, tree_width=int(w))
            for w in args.tree_widths
        ),
    ]
    for category in csv_list(args.categories):
        prompts = [token_ids(ours, p) for p in load_category(category, args.num_prompts, {})]
        for engine in (ours, eagle):  # prefix caches
            engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
        tallies = {m.name: Tally() for m in modes}
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                seqs, seconds = run(mode, prompts, args.max_tokens)
                tallies[mode.name].add(seqs, seconds)
                print(f"  {category} round {r + 1} {mode.name}: "
                      f"{tallies[mode.name].rates[-1]:.2f} tok/s", flush=True)  # fmt: skip
        report(category, tallies)
    return 0


def report(category: str, tallies: dict[str, Tally]) -> None:
    plain = statistics.median(tallies["plain"].rates)
    print(f"\n{category}: mode | tok/s | x plain | tokens / verify pass | equal to plain")
    for name, t in tallies.items():
        rate = statistics.median(t.rates)
        per_pass = t.tokens / t.passes if t.passes else 1.0
        same = t.outputs == tallies["plain"].outputs
        print(f"  {name} | {rate:.2f} | {rate / plain:.2f} | {per_pass:.2f} | {same}")
    for name, t in tallies.items():
        if "eagle3" in name and t.drafted_per_pos:
            rates = [
                a / d if d else 0.0
                for a, d in zip(t.accepted_per_pos, t.drafted_per_pos, strict=True)
            ]
            print(f"  {name} acceptance by position: " + " / ".join(f"{x:.2f}" for x in rates))


if __name__ == "__main__":
    raise SystemExit(main())
