"""The data an EAGLE-3 head trains on: text this machine has offline, tokenized with the target's
tokenizer, and the target's own features over it, teacher-forced.

Text of two kinds, packed into one stream of fixed-length chunks:
- the target's own answers: prompts of the bench's categories (HumanEval, MT-Bench, the evals
  registry's qa and math), the held-out ones left out, answered greedily by the engine itself.
  This is what a head drafts at serving time: the target's text after its chat template;
- Python sources of the installed packages (code) and the repo's docs (prose), files drawn in a
  seeded order and interleaved source by source.
- the target's answers to a chat prompt set (tools/eagle3_prompts.py), with the features the
  engine computed while answering (`captured_answers`): no second forward over them.

Features come from the engine's own forward (`native_features`: the kernels the target serves
on), teacher-forced: at each position the streams entering the head's three aux layers (vLLM's
ids: j is the stream entering layer j, the number of layers the last layer's output before the
final norm) and the target's greedy next token, which is what a drafted token must equal to be
accepted. `extract_features` does the same through transformers, the reference.
"""

from __future__ import annotations

import random
import sysconfig
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.model.runner import ForwardInput, ModelRunner

UNKNOWN = -1  # a position whose greedy pick was not computed (a prompt's, in captured answers)

MAX_FILE_BYTES = 64_000  # bigger files are mostly data tables, not code anyone writes by hand
REPO = Path(__file__).resolve().parents[1]


def default_sources() -> list[Path]:
    return [Path(sysconfig.get_paths()["purelib"]), REPO / "docs"]


def _files(source: Path, rng: random.Random) -> list[Path]:
    if source.is_file():
        return [source]
    found = [
        p
        for p in sorted(source.rglob("*"))
        if p.suffix in (".py", ".md") and p.is_file() and 200 < p.stat().st_size < MAX_FILE_BYTES
    ]
    rng.shuffle(found)
    return found


def sample_texts(sources: list[Path], seed: int) -> Iterator[tuple[Path, str]]:
    """Files of every source in a seeded order, one from each source in turn."""
    rng = random.Random(seed)
    queues = [_files(s, rng) for s in sources]
    while any(queues):
        for queue in queues:
            if queue:
                path = queue.pop()
                yield path, path.read_text(errors="replace")


def token_chunks(
    tokenizer: Any,  # the target's (a transformers tokenizer)
    texts: Iterator[tuple[Path, str]],
    seq_len: int,
    max_tokens: int,
    per_file: int,  # at most this many tokens of one file, so no file dominates
    first: Sequence[list[int]] = (),  # token sequences that go first (the answers)
) -> tuple[torch.Tensor, list[str]]:  # [num_chunks, seq_len] long, the files used
    eos = tokenizer.eos_token_id
    stream = [t for seq in first for t in [*seq, eos]]
    used: list[str] = []
    for path, text in texts:
        if len(stream) >= max_tokens:
            break
        stream += tokenizer(text)["input_ids"][:per_file] + [eos]
        used.append(str(path))
    num = min(len(stream), max_tokens) // seq_len
    if num == 0:
        raise ValueError(f"only {len(stream)} tokens of text, fewer than one chunk of {seq_len}")
    return torch.tensor(stream[: num * seq_len]).view(num, seq_len), used


# The bench's held-out prompts: every `--num-prompts N` (N <= HELD_OUT) sample with seed 0 of a
# category is among the first HELD_OUT of `sample_prompts(..., HELD_OUT, 0)` (random.sample's
# picks do not depend on the count there), so no benchmark prompt is ever trained on.
HELD_OUT = 21
ANSWER_CATEGORIES = ("code", "chat", "math")  # short prompts: the answers are the point


def training_prompts(count: int, seed: int) -> list[Any]:  # bench.serving.datasets.Prompt
    """`count` prompts for the target to answer: the categories' prompts less the held-out ones,
    taken category by category in turn."""
    from bench.serving.datasets import load_builtin, sample_prompts

    queues = []
    for category in ANSWER_CATEGORIES:
        prompts = load_builtin(category)
        held = {p.prompt_id for p in sample_prompts(prompts, HELD_OUT, 0)}
        rest = [p for p in prompts if p.prompt_id not in held]
        random.Random(seed).shuffle(rest)
        queues.append(rest)
    picked: list[Any] = []
    while len(picked) < count and any(queues):
        picked += [q.pop() for q in queues if q][: count - len(picked)]
    return picked


def target_answers(
    engine: Any,  # engine.core.llm_engine.LLMEngine of the target
    prompts: list[Any],
    max_tokens: int,
    batch: int = 16,
) -> list[list[int]]:  # each prompt's ids followed by the target's greedy answer
    """The target's own greedy answers, `batch` prompts at a time, with progress."""
    from bench.serving.peers import prompt_ids
    from engine.sample.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    done: list[list[int]] = []
    started = time.monotonic()
    for start in range(0, len(prompts), batch):
        ids = [prompt_ids(engine.tokenizer, p) for p in prompts[start : start + batch]]
        for prompt, seq in zip(ids, engine.generate(ids, params), strict=True):
            done.append(prompt + list(seq.output_token_ids))
        answered = sum(len(d) for d in done)
        print(
            f"answers: {len(done)}/{len(prompts)} prompts, {answered} tokens "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return done


@dataclass(frozen=True)
class Features:
    """The target's view of each chunk, position by position."""

    tokens: torch.Tensor  # [N, T] long: the text
    aux: torch.Tensor  # [N, T, 3 * target_hidden]: streams entering the aux layers, in order
    greedy: torch.Tensor  # [N, T] long: the target's pick after each position, or UNKNOWN

    def __add__(self, other: Features) -> Features:
        return Features(
            *(torch.cat([a, b]) for a, b in zip(self.fields(), other.fields(), strict=True))
        )

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens, self.aux, self.greedy


def _stream_hooks(
    model: nn.Module, layer_ids: tuple[int, ...], kept: dict[int, torch.Tensor]
) -> list[Any]:
    """Hooks that keep the stream entering layer j (the last layer's output for j = depth)."""
    layers: nn.ModuleList = model.model.layers  # type: ignore[union-attr,assignment]

    def keep_input(j: int) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            kept[j] = args[0] if args else kwargs["hidden_states"]

        return hook

    def keep_output(j: int) -> Any:
        def hook(_: nn.Module, __: Any, out: Any) -> None:
            kept[j] = out[0] if isinstance(out, tuple) else out

        return hook

    handles = []
    for j in layer_ids:
        if j < len(layers):
            handles.append(layers[j].register_forward_pre_hook(keep_input(j), with_kwargs=True))
        else:
            handles.append(layers[-1].register_forward_hook(keep_output(j)))
    return handles


@torch.no_grad()
def extract_features(
    model: nn.Module,  # a transformers causal LM
    chunks: torch.Tensor,  # [N, T]
    layer_ids: tuple[int, ...],
    batch: int,
    log_every_s: float = 30.0,
) -> Features:
    kept: dict[int, torch.Tensor] = {}
    handles = _stream_hooks(model, layer_ids, kept)
    aux, greedy, last = [], [], time.monotonic()
    try:
        for start in range(0, chunks.shape[0], batch):
            logits = model(chunks[start : start + batch]).logits  # [B, T, vocab]
            greedy.append(logits.argmax(-1))
            aux.append(torch.cat([kept[j] for j in layer_ids], dim=-1).to(torch.bfloat16))
            if time.monotonic() - last > log_every_s:
                print(f"features: {start + batch}/{chunks.shape[0]} chunks", flush=True)
                last = time.monotonic()
    finally:
        for h in handles:
            h.remove()
    return Features(chunks, torch.cat(aux), torch.cat(greedy))


@torch.no_grad()
def native_features(
    runner: ModelRunner,  # the target on the engine's kernels, aux layers kept, a KV pool
    chunks: torch.Tensor,  # [N, T]
    log_every_s: float = 30.0,
) -> Features:
    """`extract_features` on the serving path: one prefill a chunk over the same KV blocks,
    every position's logits for the greedy picks."""
    n, t = chunks.shape
    table = list(range(-(-t // runner.block_size)))
    aux, greedy, last, started = [], [], time.monotonic(), time.monotonic()
    for i in range(n):
        logits = runner.forward([ForwardInput(chunks[i].tolist(), 0, table, t)])  # [T, vocab]
        greedy.append(logits.argmax(-1))
        aux.append(runner.aux_hidden(table, 0, t).to(torch.bfloat16))  # [T, 3 * hidden]
        if time.monotonic() - last > log_every_s:
            rate = (i + 1) * t / (time.monotonic() - started)
            print(f"features: {i + 1}/{n} chunks ({rate:.0f} tokens/s)", flush=True)
            last = time.monotonic()
    return Features(chunks, torch.stack(aux), torch.stack(greedy))


def draft_vocabulary(
    greedy: torch.Tensor,  # [N, T]: the target's picks, what the head must predict
    size: int,
    vocab_size: int,
    stop_ids: list[int],
) -> torch.Tensor:  # [draft_vocab] long, ascending target ids
    """The `size` ids the target picks most often, the stop ids always among them."""
    counts = torch.bincount(greedy[greedy != UNKNOWN], minlength=vocab_size).float()
    counts[torch.tensor(stop_ids, dtype=torch.long)] = float("inf")
    size = min(size, vocab_size)
    return counts.topk(size).indices.sort().values


def captured_answers(
    engine: Any,  # engine.core.llm_engine.LLMEngine keeping the head's aux layers (an EAGLE-3 one)
    prompts: list[list[int]],  # token ids, a chat template applied
    max_tokens: int,
    seq_len: int,
    log_every_s: float = 30.0,
) -> Features:  # the requests packed in order into [N, seq_len] chunks, the tail dropped
    """The target's greedy answers together with its features as it computed them while
    answering: a finished request's aux hidden states are read from the pool before its blocks
    go back, so no second forward runs over the answers. The pick after an answer position is
    the answer's next token; the prompt's positions are UNKNOWN (the head drafts answers)."""
    from engine.sample.sampling_params import SamplingParams

    keeper = _AnswerKeeper(engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, ids in enumerate(prompts):
        engine.add_request(f"chat-{i}", ids, params)
    started = last = time.monotonic()
    with keeper:
        while engine.has_unfinished():
            engine.step()
            if time.monotonic() - last > log_every_s:
                answered = sum(len(t) for t, _, _ in keeper.kept.values())
                rate = answered / (time.monotonic() - started)
                print(f"answers: {len(keeper.kept)}/{len(prompts)} requests, {answered} "
                      f"tokens ({rate:.0f} tokens/s)", flush=True)  # fmt: skip
                last = time.monotonic()
    return packed([keeper.kept[f"chat-{i}"] for i in range(len(prompts))], seq_len)


class _AnswerKeeper:
    """While entered, the scheduler's `finish` first keeps the request's computed tokens, the
    target's picks after them and their features (the pool's, before its blocks go back)."""

    def __init__(self, engine: Any) -> None:
        self.runner, self.scheduler = engine.target, engine.scheduler
        self.finish = self.scheduler.finish
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __enter__(self) -> None:
        self.scheduler.finish = self.keep

    def __exit__(self, *_: object) -> None:
        self.scheduler.finish = self.finish

    def keep(self, seq: Any, reason: str, stop_reason: int | str | None = None) -> None:
        n = seq.num_computed_tokens  # positions with features; the pick after n - 1 is known
        tokens = torch.tensor(seq.token_ids[: n + 1])
        start = seq.num_prompt_tokens  # the answer's first token: the pick after the prompt
        greedy = torch.cat([torch.full((start - 1,), UNKNOWN), tokens[start:]])  # [n]
        aux = self.runner.aux_hidden(seq.block_table, 0, n).to(torch.bfloat16)  # [n, 3 * hidden]
        self.kept[seq.request_id] = tokens[:n], aux, greedy
        self.finish(seq, reason, stop_reason)


def packed(
    streams: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],  # tokens, aux, picks each
    seq_len: int,
) -> Features:
    """Requests one after another in [N, seq_len] chunks, the tail that fills no chunk dropped."""
    tokens, aux, greedy = (torch.cat(parts) for parts in zip(*streams, strict=True))
    num = tokens.numel() // seq_len
    if num == 0:
        raise ValueError(f"only {tokens.numel()} tokens answered, fewer than one chunk")
    cut = num * seq_len
    return Features(
        tokens[:cut].view(num, seq_len),
        aux[:cut].view(num, seq_len, -1),
        greedy[:cut].view(num, seq_len),
    )
