"""`specserve bench`: speculative vs plain decoding by prompt category and load, peers beside it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.serving.options import BUILTIN, DEFAULT_CATEGORIES


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help=__doc__, description=__doc__)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument(
        "--launch",
        type=Path,
        metavar="CONFIG",
        help="start `specserve serve --config CONFIG`, stop it after",
    )
    p.add_argument(
        "--serve-args", default="", help="extra flags for the launched server (one string)"
    )
    p.add_argument("--device", help="device for the launched server and the peers (e.g. cuda)")
    p.add_argument("--dtype", help="dtype for the launched server and the peers")
    p.add_argument("--model", help="model name in requests (default: the server's first)")
    p.add_argument(
        "--categories",
        help=f"comma list (default {DEFAULT_CATEGORIES}); built in: {BUILTIN}; or --dataset names",
    )
    p.add_argument(
        "--dataset",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a JSONL of {prompt} or {messages} lines as category NAME (repeatable)",
    )
    p.add_argument(
        "--concurrency", default="1,4,16", help="comma list of closed-loop concurrency levels"
    )
    p.add_argument(
        "--request-rate", default="", help="comma list of Poisson arrival rates (requests/s)"
    )
    p.add_argument(
        "--max-concurrency", type=int, help="cap on requests in flight in request-rate mode"
    )
    p.add_argument("--num-prompts", type=int, default=10, help="prompts per category")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--ignore-eos", action="store_true", help="fixed output length: always max-tokens"
    )
    p.add_argument("--repeats", type=int, default=1, help="repeat the sweep; figures are medians")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling and arrival schedule")
    p.add_argument(
        "--peers",
        "--peer",
        default="",
        help="comma list of at most one llama.cpp server (in the same rounds at c=1, on the "
        "same GGUF: llamacpp, llama-cpp-python's; llama-server, llama-server-draft, "
        "llama-server-ngram, llama.cpp's own, plain or speculative; docs/PEERS.md) and of hf, "
        "hf-assisted, hf-prompt-lookup",
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        metavar="BINARY",
        help="the llama-server binary (default: the one `make llama-server` puts in the venv)",
    )
    p.add_argument(
        "--peer-model",
        help="target model for the peers, a .gguf file for llamacpp (default: the config's)",
    )
    p.add_argument(
        "--peer-draft-model",
        help="draft for hf-assisted, a .gguf file for llama-server-draft (default: the config's)",
    )
    p.add_argument(
        "--peer-threads",
        type=int,
        help="threads for the peers (default: the config's num_threads, else the llama.cpp peers "
        "take the physical cores and hf all cores)",
    )
    p.add_argument(
        "--peer-k",
        type=int,
        help="assistant / prompt-lookup / llama-server-draft tokens per step (default: the "
        "config's k)",
    )
    p.add_argument(
        "--peer-num-prompts",
        type=int,
        help="peers run only the first N prompts of each category (default: all)",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="an A/A run: the spec mode's requests decode plainly too, so its 'speedup' is the "
        "noise between two paired rounds of identical work on this host",
    )
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument(
        "--no-prime",
        action="store_true",
        help="do not send each prompt once before measuring (then the mode that meets a prompt "
        "first pays its prefill and the other finds it cached)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--launch-timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument(
        "--raw-logs",
        type=Path,
        metavar="DIR",
        help="requests.jsonl and the servers' logs (default: a new folder in "
        "~/.cache/specserve/bench-logs/)",
    )
    p.set_defaults(func=run)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from bench.serving import orchestrate

    return orchestrate.main(args)
