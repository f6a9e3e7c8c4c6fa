"""`specserve` command line: each subcommand lives in its own module and registers itself."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    # Subcommand modules import heavy libraries (torch, transformers) only inside their handlers.
    from bench.serving import cli as bench_cli
    from engine.model import bundled
    from server import command as serve_command

    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_command.add_parser(sub)
    bundled.add_parser(sub)
    bench_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
