"""The data an EAGLE-3 head trains on: text this machine has offline, tokenized with the target's
tokenizer, and the target's own features over it, teacher-forced.

Text: Python sources of the installed packages (code) and the repo's docs (prose), files drawn in
a seeded order and interleaved source by source. Features come from transformers running the
target (a GGUF through the repo's converter, `load_model(..., "none")`): at each position the
streams entering the head's three aux layers (vLLM's ids: j is the stream entering layer j, the
number of layers the last layer's output before the final norm) and the target's greedy next
token, which is what a drafted token must equal to be accepted.
"""

from __future__ import annotations

import random
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

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
) -> tuple[torch.Tensor, list[str]]:  # [num_chunks, seq_len] long, the files used
    stream: list[int] = []
    used: list[str] = []
    eos = tokenizer.eos_token_id
    for path, text in texts:
        if len(stream) >= max_tokens:
            break
        stream += tokenizer(text)["input_ids"][:per_file] + [eos]
        used.append(str(path))
    num = min(len(stream), max_tokens) // seq_len
    if num == 0:
        raise ValueError(f"only {len(stream)} tokens of text, fewer than one chunk of {seq_len}")
    return torch.tensor(stream[: num * seq_len]).view(num, seq_len), used


@dataclass(frozen=True)
class Features:
    """The target's view of each chunk, position by position."""

    tokens: torch.Tensor  # [N, T] long: the text
    aux: torch.Tensor  # [N, T, 3 * target_hidden]: streams entering the aux layers, in order
    greedy: torch.Tensor  # [N, T] long: the target's argmax after each position's prefix


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


def draft_vocabulary(
    greedy: torch.Tensor,  # [N, T]: the target's picks, what the head must predict
    size: int,
    vocab_size: int,
    stop_ids: list[int],
) -> torch.Tensor:  # [draft_vocab] long, ascending target ids
    """The `size` ids the target picks most often, the stop ids always among them."""
    counts = torch.bincount(greedy.flatten(), minlength=vocab_size).float()
    counts[torch.tensor(stop_ids, dtype=torch.long)] = float("inf")
    size = min(size, vocab_size)
    return counts.topk(size).indices.sort().values
