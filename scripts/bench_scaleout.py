"""Short scale-out measurements: one replica, two replicas behind vllm-router, TP 1 vs TP 2.

    python scripts/bench_scaleout.py --layout one   --threads 2 --concurrency 8
    python scripts/bench_scaleout.py --layout two   --threads 1 --concurrency 8
    python scripts/bench_scaleout.py --layout tp    --tp 2 --threads 1 --concurrency 1

Starts the servers (and the router) itself, sends one warm-up request per replica, then a
closed loop of --requests completions (--max-tokens each, ignore_eos, greedy) at the given
concurrency, and prints one JSON line: output tokens/s and per-request latency.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "def quicksort(items):",
    "Write a haiku about autumn.",
    "Explain what a hash map is.",
    "for i in range(10):",
    "The capital of France is",
    "class LinkedList:",
    "SELECT name FROM users WHERE",
    "import numpy as np\n",
]


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} never became ready")


def serve_cmd(args: argparse.Namespace, port: int, tp: int) -> list[str]:
    return [
        sys.executable, "-m", "specserve", "serve", "--config", args.config,
        "--port", str(port), "--num-threads", str(args.threads),
        "--max-num-seqs", str(args.concurrency), "--tensor-parallel-size", str(tp),
        "--speculative-method", args.speculative_method,
    ]  # fmt: skip


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=900)
    r.raise_for_status()
    return time.perf_counter() - started, int(r.json()["usage"]["completion_tokens"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layout", choices=["one", "two", "tp"], required=True)
    p.add_argument("--config", default="configs/cpu-small.yaml")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--speculative-method", default="none")
    p.add_argument("--port", type=int, default=18400)
    p.add_argument("--logs", default="bench-out/scaleout")
    args = p.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        replicas = 2 if args.layout == "two" else 1
        tp = args.tp if args.layout == "tp" else 1
        urls = [f"http://127.0.0.1:{args.port + 1 + i}" for i in range(replicas)]
        for i in range(replicas):
            procs.append(start(serve_cmd(args, args.port + 1 + i, tp), logs / f"replica-{i}.log"))
        for url, proc in zip(urls, procs, strict=True):
            wait_ready(url, proc)
        target = urls[0]
        if args.layout == "two":
            router = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
            target = f"http://127.0.0.1:{args.port}"
            cmd = [router, "--port", str(args.port), "--policy", "round_robin",
                   "--worker-urls", *urls, "--worker-startup-check-interval", "1"]  # fmt: skip
            procs.append(start(cmd, logs / "router.log"))
            wait_ready(target, procs[-1])
        for url in urls:
            one_request(url, "warm up", 4)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            done = list(pool.map(lambda q: one_request(target, q, args.max_tokens), prompts))
        seconds = time.perf_counter() - started
        tokens = sum(n for _, n in done)
        latencies = sorted(s for s, _ in done)
        print(json.dumps({
            "layout": args.layout, "tp": tp, "replicas": replicas, "threads": args.threads,
            "concurrency": args.concurrency, "requests": args.requests,
            "max_tokens": args.max_tokens, "seconds": round(seconds, 2),
            "output_tokens_per_s": round(tokens / seconds, 2),
            "latency_p50_s": round(statistics.median(latencies), 2),
        }))  # fmt: skip
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
