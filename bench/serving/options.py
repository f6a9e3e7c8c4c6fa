"""What `specserve bench`'s flags mean once parsed: the categories, the datasets, the server to
measure (a running one, or one launched for the run), and the bench's log line."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

DEFAULT_CATEGORIES = "code,chat,summarization"
BUILTIN = "code, chat, summarization, translation, qa, math, structured"


def csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_datasets(items: list[str]) -> dict[str, Path]:
    found = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--dataset wants NAME=PATH, not {item!r}")
        found[name] = Path(path)
    return found


def chosen_categories(args: argparse.Namespace, datasets: dict[str, Path]) -> list[str]:
    default = "" if datasets else DEFAULT_CATEGORIES
    categories = csv_list(args.categories if args.categories is not None else default)
    return categories + [name for name in datasets if name not in categories]


def serve_extra(args: argparse.Namespace) -> list[str]:
    extra = shlex.split(args.serve_args)
    for flag, value in (("--device", args.device), ("--dtype", args.dtype)):
        if value:
            extra += [flag, value]
    return extra


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[str]:
    if args.base_url:
        yield args.base_url.rstrip("/")
        return
    from bench.serving.launcher import launched_server

    with launched_server(
        args.launch, serve_extra(args), args.raw_logs / "server.log", args.launch_timeout
    ) as url:
        yield url


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr)
