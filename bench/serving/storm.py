"""A retry storm: N openai-SDK clients at once against one server, against a steady load.

    python -m bench.serving.storm --model DIR --draft-model DIR --clients 1000,5000,10000

Starts `specserve serve` (draft speculation), then measures the tokens/s it delivers to a steady
closed loop of `--steady` clients (the reference), then fires N one-shot completions at the same
instant from `--processes` processes (so the load generator is not one process), for each N of
`--clients`, a steady reference right before each storm. Every client is the openai SDK's `AsyncOpenAI` with its default retries and
timeout (2 retries honouring `Retry-After`, 600 s); a process shares one HTTP pool sized for its
clients. A storm's tokens/s is the completion tokens its clients received over the time from the
start to the last answer; the report gives its ratio to the steady rate, the clients' errors, the
HTTP statuses they saw (429s included), the server's refusals by reason, the Retry-After it
advised and its peak RSS. Prints one JSON object; `--out` also writes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serving.launcher import free_port, stop, wait_healthy
from bench.serving.machine import cpu_info

PROMPT = "Once upon a time there was a little server that"
START_DELAY_S = 5.0  # the worker processes build their clients and pools before the start


@dataclass
class Outcome:
    """What one process's clients got."""

    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    statuses: Counter[int] = field(default_factory=Counter)  # every HTTP answer, retries too
    latencies_s: list[float] = field(default_factory=list)
    last_answer: float = 0.0  # wall clock
    cpu_s: float = 0.0  # what the clients' processes spent (they share the host with the server)

    def merge(self, other: Outcome) -> None:
        self.ok += other.ok
        self.errors.update(other.errors)
        self.tokens += other.tokens
        self.statuses.update(other.statuses)
        self.latencies_s += other.latencies_s
        self.last_answer = max(self.last_answer, other.last_answer)
        self.cpu_s += other.cpu_s


# ---------------------------------------------------------------------------- the clients


def sdk_client(
    base_url: str, connections: int, statuses: Counter[int], connect_timeout_s: float | None
) -> Any:
    """The SDK's client with its own defaults (retries; the timeout unless `connect_timeout_s`
    replaces its 5 s for connecting), on a pool wide enough for every client of this process
    (the SDK's default pool holds 1,000 connections)."""
    import httpx2
    import openai

    async def seen(response: Any) -> None:
        statuses[response.status_code] += 1

    kwargs: dict[str, Any] = {
        "limits": httpx2.Limits(max_connections=connections, max_keepalive_connections=connections),
        "event_hooks": {"response": [seen]},
    }
    if connect_timeout_s is not None:
        kwargs["timeout"] = httpx2.Timeout(600.0, connect=connect_timeout_s)
    http = openai.DefaultAsyncHttpxClient(**kwargs)
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="storm", http_client=http)


async def one_request(client: Any, out: Outcome, max_tokens: int) -> None:
    started = time.time()
    try:
        response = await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
    except Exception as exc:  # noqa: BLE001 - a client's failure is a result, counted by kind
        cause = exc.__cause__ or exc.__context__
        out.errors[type(exc).__name__ + (f"({type(cause).__name__})" if cause else "")] += 1
        return
    out.ok += 1
    out.tokens += response.usage.completion_tokens
    out.last_answer = time.time()
    out.latencies_s.append(out.last_answer - started)


async def storm_clients(
    url: str,
    n: int,
    start_at: float,
    end_at: float,
    max_tokens: int,
    ramp_s: float,
    connect_timeout_s: float | None,
) -> Outcome:
    """`n` one-shot requests at `start_at` (or spread evenly over `ramp_s` seconds from it);
    those still unanswered at `end_at` are counted."""
    out = Outcome()
    client = sdk_client(url, max(n, 1), out.statuses, connect_timeout_s)

    async def client_k(k: int) -> None:
        await asyncio.sleep(max(0.0, start_at + ramp_s * k / n - time.time()))
        await one_request(client, out, max_tokens)

    tasks = [asyncio.create_task(client_k(k)) for k in range(n)]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, end_at - time.time()))
    for task in pending:
        task.cancel()
    if pending:
        out.errors["unanswered at the bound"] = len(pending)
    await asyncio.gather(*pending, return_exceptions=True)
    await client.close()
    return out


async def steady_clients(url: str, n: int, start_at: float, end_at: float, tokens: int) -> Outcome:
    """`n` clients that each send a request as soon as their last one is answered."""
    out = Outcome()
    client = sdk_client(url, max(n, 1), out.statuses, None)
    await asyncio.sleep(max(0.0, start_at - time.time()))

    async def loop() -> None:
        while time.time() < end_at:
            await one_request(client, out, tokens)

    await asyncio.gather(*(loop() for _ in range(n)))
    await client.close()
    return out


def run_worker(
    kind: str, url: str, n: int, start_at: float, end_at: float, tokens: int,
    ramp_s: float = 0.0, connect_timeout_s: float | None = None,
) -> Outcome:  # fmt: skip
    cpu = time.process_time()
    out = _run_worker(kind, url, n, start_at, end_at, tokens, ramp_s, connect_timeout_s)
    out.cpu_s = time.process_time() - cpu
    return out


def _run_worker(
    kind: str, url: str, n: int, start_at: float, end_at: float, tokens: int, ramp_s: float,
    connect_timeout_s: float | None,
) -> Outcome:  # fmt: skip
    if kind == "warm":
        import openai  # noqa: F401 - the SDK's import is slow; keep it out of the first phase

        time.sleep(1.0)  # long enough for the pool to hand each worker one of these
        return Outcome()
    if kind == "storm":
        return asyncio.run(
            storm_clients(url, n, start_at, end_at, tokens, ramp_s, connect_timeout_s)
        )
    return asyncio.run(steady_clients(url, n, start_at, end_at, tokens))


def shares(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def fire(pool: ProcessPoolExecutor, kind: str, url: str, n: int, args: argparse.Namespace,
         duration_s: float = 0.0) -> tuple[Outcome, float]:  # fmt: skip
    """Run `n` clients spread over the pool's processes; the outcome and the start time."""
    start_at = time.time() + START_DELAY_S
    end_at = start_at + duration_s
    parts = shares(n, args.processes)
    futures = [
        pool.submit(
            run_worker,
            kind,
            url,
            k,
            start_at,
            end_at,
            args.max_tokens,
            args.ramp_s,
            args.connect_timeout_s,
        )
        for k in parts
    ]
    total = Outcome()
    for future in futures:
        total.merge(future.result())
    return total, start_at


# ---------------------------------------------------------------------------- the server


def serve(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "specserve", "serve", "--model", args.model,
        "--served-model-name", "tiny", "--dtype", "float32", "--port", str(port),
        "--speculative-method", "draft", "--draft-model", args.draft_model,
        "--num-speculative-tokens", "3", "--num-threads", str(args.threads),
        "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning", *args.serve_args,
    ]  # fmt: skip
    print(f"storm: {' '.join(cmd)}", file=sys.stderr)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    wait_healthy(f"http://127.0.0.1:{port}/health", proc, log, 1800.0)
    return proc


class PeakRss:
    """The server's peak resident memory, sampled every half second."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_mib = 0.0
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak_mib = max(self.peak_mib, rss_mib(self.pid))
            time.sleep(0.5)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return self.peak_mib


def rss_mib(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    line = next((ln for ln in status.splitlines() if ln.startswith("VmRSS:")), "VmRSS: 0 kB")
    return int(line.split()[1]) / 1024


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time (/proc/PID/stat, in clock ticks)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_counts(url: str) -> dict[str, float]:
    """The admission and goodput series, summed over their labels (reason and status kept)."""
    wanted = ("request_refused_total", "retry_after_seconds_count", "retry_after_seconds_sum",
              "goodput_tokens_total")  # fmt: skip
    counts: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=60).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removeprefix("specserve:")
            if name in wanted:
                label = s.labels.get("reason") or s.labels.get("status") or ""
                counts[f"{name}{{{label}}}" if label else name] = s.value
    return counts


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


# ---------------------------------------------------------------------------- the phases


def warm(pool: ProcessPoolExecutor, args: argparse.Namespace) -> None:
    futures = [pool.submit(run_worker, "warm", "", 0, 0.0, 0.0, 0) for _ in range(args.processes)]
    for future in futures:
        future.result()


def steady(
    pool: ProcessPoolExecutor, url: str, pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    cpu = cpu_seconds(pid)
    out, start = fire(pool, "steady", url, args.steady, args, args.steady_s)
    elapsed = max(out.last_answer, start + args.steady_s) - start
    report = summary(out, elapsed, args.steady) | {"clients": args.steady, "kind": "steady"}
    report["cpu_s"] = {"server": round(cpu_seconds(pid) - cpu, 1), "clients": round(out.cpu_s, 1)}
    return report


def storm(
    pool: ProcessPoolExecutor, url: str, n: int, pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    before = server_counts(url)
    rss_before, peak, cpu = rss_mib(pid), PeakRss(pid), cpu_seconds(pid)
    out, start = fire(pool, "storm", url, n, args, args.bound_s)
    server_cpu_s = cpu_seconds(pid) - cpu
    unanswered = out.errors.get("unanswered at the bound", 0)
    elapsed = (start + args.bound_s if unanswered else out.last_answer) - start
    server = delta(server_counts(url), before)
    report = summary(out, elapsed, n) | {"clients": n, "kind": "storm", "server": server}
    report["rss_mib"] = {"before": round(rss_before), "peak": round(peak.stop())}
    report["cpu_s"] = {"server": round(server_cpu_s, 1), "clients": round(out.cpu_s, 1)}
    advised = server.get("retry_after_seconds_count{429}", 0.0)
    if advised:
        report["mean_retry_after_s"] = server["retry_after_seconds_sum{429}"] / advised
    return report


def summary(out: Outcome, elapsed_s: float, clients: int) -> dict[str, Any]:
    lat = sorted(out.latencies_s) or [0.0]
    return {
        "completed": out.ok,
        "errors": dict(out.errors),
        "http_statuses": {str(k): v for k, v in sorted(out.statuses.items())},
        "tokens": out.tokens,
        "seconds": round(elapsed_s, 2),
        "tokens_per_s": round(out.tokens / elapsed_s, 1) if elapsed_s > 0 else 0.0,
        "latency_s": {
            "p50": round(statistics.median(lat), 2),
            "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2),
            "max": round(lat[-1], 2),
        },
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(args, port, Path(args.log))
    results: dict[str, Any] = {"cpu": cpu_info().summary(), "args": vars(args)}
    try:
        with ProcessPoolExecutor(args.processes, mp_context=get_context("spawn")) as pool:
            warm(pool, args)
            for n in args.clients:  # a steady reference right before each storm: the host drifts
                ref = steady(pool, url, proc.pid, args)
                print(f"storm: steady {json.dumps(ref)}", file=sys.stderr)
                report = storm(pool, url, n, proc.pid, args)
                rate = ref["tokens_per_s"]
                report["vs_steady"] = round(report["tokens_per_s"] / rate, 3) if rate else None
                results[f"storm_{n}"] = {"steady": ref, "storm": report}
                print(f"storm: {n} {json.dumps(report)}", file=sys.stderr)
    finally:
        stop(proc)
    return results


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="the target's folder (a tiny model)")
    p.add_argument("--draft-model", required=True, help="the draft's folder")
    p.add_argument("--clients", default="1000,5000,10000", help="storm sizes, comma-separated")
    p.add_argument("--steady", type=int, default=64, help="clients of the steady reference")
    p.add_argument("--steady-s", type=float, default=30.0, help="seconds of the steady load")
    p.add_argument("--processes", type=int, default=4, help="client processes")
    p.add_argument("--bound-s", type=float, default=900.0, help="a storm's time limit")
    p.add_argument(
        "--ramp-s", type=float, default=0.0,
        help="start a storm's clients evenly over this many seconds (0: all at once)",
    )  # fmt: skip
    p.add_argument(
        "--connect-timeout-s", type=float, default=None,
        help="a storm's clients' connect timeout (default: the SDK's 5 s); a host too small to "
        "run the clients and the server together starves the clients' own event loops past it",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument(
        "--log", default="bench-out/storm-server.log", help="the server's log (ignored by git)"
    )
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("serve_args", nargs="*", help="more `specserve serve` flags, after --")
    args = p.parse_args(argv)
    args.clients = [int(n) for n in str(args.clients).split(",") if n]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    results = run(args)
    text = json.dumps(results, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
