"""Does a bare `specserve serve --model FILE.gguf` run as fast as the shipped config? Plain decode
of the bundled target through the server, two ways, in alternating rounds:

    config: specserve serve --config configs/default.yaml --speculative-method none
    bare:   specserve serve --model <the target's .gguf>           (every other setting default)

Each round starts one server, sends a warm-up and then `--requests` short chat requests one at a
time (greedy, `--max-tokens` tokens, EOS ignored), and takes the median decode tok/s (tokens
after the first over the time since the first). The report is each round's median and the ratio
bare / config of the medians over rounds, with the CPU it ran on.

    python -m bench.bare_model --rounds 2 --requests 5 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.engine_args import BUNDLED_TARGET, cpu_flags
from bench.serving.launcher import free_port, launched

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash map is in two sentences.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What is the difference between a list and a tuple in Python?",
    "Write a C function that reverses a linked list.",
    "Give three tips for writing readable code.",
)


def server_args(way: str, model_file: str) -> list[str]:
    if way == "config":
        return ["--config", str(ROOT / "configs/default.yaml"), "--speculative-method", "none"]
    return ["--model", model_file]


def decode_rate(url: str, prompt: str, max_tokens: int) -> float:
    """One streamed greedy chat request: tokens after the first over the time since the first."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    stamps: list[float] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    stamps.append(time.monotonic())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def one_round(way: str, model_file: str, args: argparse.Namespace, logs: Path) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "specserve", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += server_args(way, model_file)
    with launched(cmd, port, logs / f"{way}-{time.monotonic_ns()}.log", 1800.0) as url:
        decode_rate(url, PROMPTS[0], 16)  # warm-up
        rates = [decode_rate(url, p, args.max_tokens) for p in PROMPTS[: args.requests]]
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    from engine.model import bundled

    model_file = str(bundled.resolve(BUNDLED_TARGET.removeprefix("bundled:")))
    print(f"CPU: {cpu_flags()}", flush=True)
    medians: dict[str, list[float]] = {"config": [], "bare": []}
    with tempfile.TemporaryDirectory() as logs:
        for r in range(args.rounds):
            for way in ("config", "bare") if r % 2 == 0 else ("bare", "config"):
                medians[way].append(one_round(way, model_file, args, Path(logs)))
                print(f"round {r + 1} {way}: {medians[way][-1]:.1f} tok/s", flush=True)
    config, bare = (statistics.median(medians[w]) for w in ("config", "bare"))
    print(
        f"median decode tok/s: config {config:.1f}, bare {bare:.1f}, bare / config {bare / config:.3f}"
    )


if __name__ == "__main__":
    main()
