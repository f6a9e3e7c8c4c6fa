"""What an EAGLE-3 head is trained from (`python -m tools.train_eagle3`): every choice of the job,
the seed included, so that a recipe (kept in the head's README.json) gives the same head again."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Recipe:
    target: str
    out: str
    seed: int = 0
    sources: tuple[str, ...] = ()  # files or folders of text; () the default (code and docs)
    tokens: int = 20_000
    per_file: int = 2048
    seq_len: int = 512
    batch: int = 4
    steps: int = 1000  # optimizer steps at most
    max_minutes: float = 15.0
    lr: float = 1e-3
    schedule: str = "linear"  # after the warm-up: linear (to zero at `steps`) or constant
    ttt_steps: int = 3
    draft_vocab: int = 8192
    intermediate_size: int = 0  # 0: the target's
    aux_layers: tuple[int, ...] = ()  # (): vLLM's default (2, L // 2, L - 3)
    log_every: int = 10
    save_dtype: str = "bfloat16"  # or float32, or int8 (rows with a scale, ~half of bfloat16)
    answers: int = 0  # training prompts the target answers first (tools/eagle3_data.py)
    answer_tokens: int = 192  # the longest answer
    answer_config: str = ""  # the engine that answers (a settings file); "": the target, plain
    chat_prompts: int = 0  # chat requests (tools/eagle3_prompts.py) answered, features captured
    chat_part: int = 700  # ... in parts of this many requests, each packed and cached on its own
    chat_tokens: int = 256  # the longest chat answer
    answer_batch: int = 16  # requests answered at once
    init_from_target: bool = True  # lm_head rows and final norm start as the target's
    head_lr_scale: float = 0.1  # the lm_head's relative learning rate where init_from_target
    cache: str = ""  # a file for the extracted features: read if there, else written
    dtype: str = "bfloat16"  # the target's activations while features are extracted


def parse(description: str, argv: list[str] | None = None) -> Recipe:
    """The recipe from the command line: a flag for each field."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", required=True, help="a folder, a .gguf or bundled:NAME")
    p.add_argument("--out", required=True, help="the head's folder")
    p.add_argument("--sources", nargs="*", default=[], help="text files or folders")
    p.add_argument("--aux-layers", type=int, nargs=3, default=[])
    defaults = Recipe("", "")
    for name, value in asdict(defaults).items():
        if isinstance(value, bool):
            flag = f"--{name.replace('_', '-')}"
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        elif isinstance(value, int | float | str) and name not in ("target", "out"):
            p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(p.parse_args(argv))
    args["sources"], args["aux_layers"] = tuple(args["sources"]), tuple(args["aux_layers"])
    if args["schedule"] not in ("linear", "constant"):
        p.error(f"--schedule {args['schedule']!r}: linear or constant")
    return Recipe(**args)
