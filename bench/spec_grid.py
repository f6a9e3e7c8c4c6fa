"""Adaptive speculation against every fixed configuration, in one engine, on the bench's prompts.

    python -m bench.spec_grid --categories code,chat,summarization --concurrency 1,8 \\
        --ks 2,4,6 --proposers draft,ngram,hybrid --num-prompts 4 --max-tokens 64 --out grid

One engine (the launch config's models, quantization and threads) serves every mode in turn, so
no mode pays a model load or sees another machine: `plain` (no drafts), `adaptive` (the planner,
ceiling k from the config) and one fixed mode per proposer and k (that many drafts every step, no
planning). A round is `concurrency` prompts started together; each round runs every mode back to
back, in an order that reverses every round, and each prompt is first put in both models' prefix
caches (`prime`) so that no mode measures a prefill or a draft catch-up another skipped. Every
mode's answers reach the planner's answer-length window, as every answer does in a server. Cells
report each mode's output tokens per second over plain's, the median over rounds (greedy, so every
mode emits the same tokens). `--control` adds a `plain again` column, plain decoding measured a
second time at the far end of each round: the spread a mode's ratio needs to exceed.
This is an engine-level companion to `specserve bench` (no HTTP, no streaming): it answers
"which configuration would have been best here" at a cost a 2-core machine can pay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from bench.serving.datasets import Prompt, load_category
from bench.serving.options import csv_list
from bench.serving.peers import prompt_ids
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec_decode.planner import SpecPlanner
from engine.spec_decode.proposers import HybridProposer, Proposer
from engine.spec_decode.proposers.forced import ForcedDraftProposer


@dataclass(frozen=True)
class Mode:
    name: str
    proposer: str  # "none", "draft", "ngram", "hybrid"
    k: int
    adaptive: bool = False


CONTROL = "plain again"


def modes_of(
    ks: list[int],
    proposers: list[str],
    adaptive_k: int,
    other_ceilings: tuple[int, ...] = (),
    control: bool = False,
) -> list[Mode]:
    """plain, adaptive (the config's ceiling), adaptive under each other ceiling, the fixed modes,
    and with `control` plain once more, last: its ratio to the first plain is the host's noise
    between the two ends of a round."""
    fixed = [Mode(f"{p} k={k}", p, k) for p in proposers for k in ks]
    others = [Mode(f"adaptive k≤{k}", "hybrid", k, True) for k in other_ceilings if k != adaptive_k]
    again = [Mode(CONTROL, "none", 0)] if control else []
    return [
        Mode("plain", "none", 0),
        Mode("adaptive", "hybrid", adaptive_k, True),
        *others,
        *fixed,
        *again,
    ]


class Switch:
    """Puts one engine into each mode: its proposer, and the planner on or off."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.planner: SpecPlanner | None = engine.planner
        inner = engine.proposer.inner  # type: ignore[attr-defined]
        if not isinstance(inner, HybridProposer):
            raise SystemExit("spec_grid needs a config with speculative_method: hybrid")
        self.proposers: dict[str, Proposer] = {
            "none": inner,
            "hybrid": inner,
            "draft": inner.draft,
            "ngram": inner.ngram,
        }

    def set(self, mode: Mode) -> None:
        planner = self.planner if mode.adaptive else None
        self.engine.planner = self.engine.scheduler.planner = planner
        self.engine.proposer = ForcedDraftProposer(self.proposers[mode.proposer])

    def observe_lengths(self, seqs: list[Sequence], mode: Mode) -> None:
        """A server's planner sees every answer finish, plain or not: so does the grid's (the
        adaptive mode's answers it saw itself)."""
        if self.planner is None or mode.adaptive:
            return
        for seq in seqs:
            self.planner.finished(seq)


def token_ids(engine: LLMEngine, prompt: Prompt) -> list[int]:
    """The prompt as the server tokenizes it, with the engine's tokenizer."""
    return prompt_ids(engine.tokenizer, prompt)


@dataclass(frozen=True)
class Run:
    finished: list[Sequence]
    tokens_per_s: float

    @property
    def drafts(self) -> tuple[int, int]:
        """(drafted, accepted) tokens over the run's requests."""
        spec = [seq.spec for seq in self.finished]
        return sum(s.num_draft_tokens for s in spec), sum(s.num_accepted_tokens for s in spec)


def run(engine: LLMEngine, prompts: list[list[int]], k: int, max_tokens: int) -> Run:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, num_speculative_tokens=k)
    started = time.perf_counter()
    seqs = engine.generate(prompts, params)
    return Run(seqs, sum(seq.num_output_tokens for seq in seqs) / (time.perf_counter() - started))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("configs/pair.yaml"))
    ap.add_argument("--categories", default="code,chat,summarization")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--proposers", default="draft,ngram,hybrid")
    ap.add_argument(
        "--adaptive-ks", default="", help="more k ceilings for the planner, beside the config's"
    )
    ap.add_argument(
        "--control",
        action="store_true",
        help=f"add a '{CONTROL}' column: plain decoding measured twice, the noise floor",
    )
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    from server.settings import Settings

    settings = Settings.load(args.config)
    ks = [int(k) for k in csv_list(args.ks)]
    config = settings.engine_config()
    adaptive_k = config.speculative.num_speculative_tokens
    ceilings = tuple(int(k) for k in csv_list(args.adaptive_ks))
    spec = replace(config.speculative, num_speculative_tokens=max([*ks, *ceilings, adaptive_k]))
    engine = LLMEngine(replace(config, speculative=spec))
    switch = Switch(engine)
    modes = modes_of(ks, csv_list(args.proposers), adaptive_k, ceilings, args.control)
    loads = [int(c) for c in csv_list(args.concurrency)]
    prompts = {
        c: [token_ids(engine, p) for p in load_category(c, args.num_prompts, {}, args.seed)]
        for c in csv_list(args.categories)
    }
    rows = []
    total = sum(-(-max(len(ps), c) // c) for ps in prompts.values() for c in loads) * len(modes)
    with tqdm(total=total, desc="grid", unit="run") as bar:
        for category, ids in prompts.items():
            bar.set_postfix_str(f"priming {category}")
            prime(engine, switch, ids)
            for c in loads:
                rates, drafts = measure(
                    engine, switch, modes, ids, c, args.max_tokens, bar, category
                )
                rows += cell_rows(category, c, rates, drafts)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grid.json").write_text(json.dumps(rows, indent=1))
    (args.out / "grid.md").write_text(table(rows, [m.name for m in modes], loads))
    print(table(rows, [m.name for m in modes], loads))
    return 0


def prime(engine: LLMEngine, switch: Switch, ids: list[list[int]]) -> None:
    """Put each prompt in both models' prefix caches: two tokens in a fixed draft mode, whose
    second step has the draft compute the prompt. Otherwise the first mode of a round to draft on
    a prompt paid the draft's catch-up (~0.2-1 s) and every later mode got its K/V free; the
    adaptive mode, second after plain in every other round, paid it there (G5: code rounds
    1.24 and 1.15 where it went first, 1.41 and 1.55 where it did not). The grid compares modes
    on decoding; the server bench (`specserve bench`) is where catch-ups are measured."""
    switch.set(Mode("prime", "draft", 1))
    engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=2, num_speculative_tokens=1))


def measure(
    engine: LLMEngine,
    switch: Switch,
    modes: list[Mode],
    ids: list[list[int]],
    c: int,
    max_tokens: int,
    bar: tqdm,
    category: str,
) -> tuple[dict[str, list[float]], dict[str, tuple[int, int]]]:
    """mode -> its tok/s over plain's, one per round; and mode -> (drafted, accepted) tokens."""
    total = -(-max(len(ids), c) // c) * c
    batch = [ids[i % len(ids)] for i in range(total)]
    ratios: dict[str, list[float]] = {m.name: [] for m in modes}
    drafts = dict.fromkeys(ratios, (0, 0))
    for r, start in enumerate(range(0, total, c)):
        speeds = {}
        for mode in modes if r % 2 == 0 else modes[::-1]:
            bar.set_postfix_str(f"{category} c={c} {mode.name}")
            switch.set(mode)
            done = run(engine, batch[start : start + c], mode.k, max_tokens)
            speeds[mode.name] = done.tokens_per_s
            (drafted, accepted), (more_drafted, more_accepted) = drafts[mode.name], done.drafts
            drafts[mode.name] = (drafted + more_drafted, accepted + more_accepted)
            switch.observe_lengths(done.finished, mode)
            bar.update(1)
        for name, speed in speeds.items():
            ratios[name].append(speed / speeds["plain"])
    return ratios, drafts


def cell_rows(
    category: str, c: int, ratios: dict[str, list[float]], drafts: dict[str, tuple[int, int]]
) -> list[dict[str, object]]:
    return [
        {
            "category": category,
            "concurrency": c,
            "mode": m,
            "speedup": statistics.median(r),
            "rounds": r,
            "drafted": drafts[m][0],
            "accepted": drafts[m][1],
        }
        for m, r in ratios.items()
    ]


def table(rows: list[dict[str, object]], modes: list[str], loads: list[int]) -> str:
    """Speedup over plain per mode; in brackets, the share of drafted tokens accepted."""
    cells = {(r["category"], r["concurrency"], r["mode"]): r for r in rows}
    categories = list(dict.fromkeys(str(r["category"]) for r in rows))
    lines = [
        "| category | c | " + " | ".join(modes) + " | adaptive ÷ best fixed |",
        "|---|---|" + "---|" * (len(modes) + 1),
    ]
    for category in categories:
        for c in loads:
            row = {m: cells[(category, c, m)] for m in modes}
            speed = {m: float(r["speedup"]) for m, r in row.items()}  # type: ignore[arg-type]
            fixed = [v for m, v in speed.items() if not m.startswith(("plain", "adaptive"))]
            best = max(fixed, default=1.0)
            marks = " | ".join(_cell(row[m]) for m in modes)
            lines.append(f"| {category} | {c} | {marks} | {speed['adaptive'] / best:.2f} |")
    return "\n".join(lines) + "\n"


def _cell(row: dict[str, object]) -> str:
    drafted, accepted = int(row.get("drafted", 0)), int(row.get("accepted", 0))  # type: ignore[call-overload]
    accept = f" ({accepted / drafted:.2f})" if drafted else ""
    return f"{float(row['speedup']):.2f}{accept}"  # type: ignore[arg-type]


if __name__ == "__main__":
    raise SystemExit(main())
