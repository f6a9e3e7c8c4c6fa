"""The whole bench run: prompts, server, interleaved sweep, peers, then results, report, plots."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from bench.serving import llama_server, llamacpp, stats
from bench.serving.client import RequestSettings
from bench.serving.datasets import Prompt, load_category
from bench.serving.machine import cpu_info
from bench.serving.options import chosen_categories, csv_list, log, parse_datasets, target
from bench.serving.peers import PEER_MODES, PeerJob, run_peers_subprocess
from bench.serving.report import write_plots, write_report
from bench.serving.runner import Load, Measurement, Runner, requests_per_measurement

Row = dict[str, Any]


def loads_of(args: argparse.Namespace) -> list[Load]:
    loads = [Load(concurrency=int(c)) for c in csv_list(args.concurrency)]
    loads += [Load(request_rate=float(r)) for r in csv_list(args.request_rate)]
    if not loads or any(load.concurrency is not None and load.concurrency < 1 for load in loads):
        raise SystemExit("need concurrency levels >= 1 or request rates")
    return loads


def load_prompts(args: argparse.Namespace) -> dict[str, list[Prompt]]:
    datasets = parse_datasets(args.dataset)
    categories = chosen_categories(args, datasets)
    if not categories:
        raise SystemExit("no categories to run")
    prompts = {}
    for category in categories:
        prompts[category] = load_category(category, args.num_prompts, datasets, args.seed)
        log(f"{category}: {len(prompts[category])} prompts")
    return prompts


# The peers that join the rounds at concurrency 1: llama.cpp servers, one per run.
LLAMA_PEERS = (llamacpp.NAME, *llama_server.PEERS)


def main(args: argparse.Namespace) -> int:
    peers = csv_list(args.peers)
    unknown = [p for p in peers if p not in (*PEER_MODES, *LLAMA_PEERS)]
    if unknown:
        raise SystemExit(f"unknown peers {unknown}; known: {', '.join(PEER_MODES + LLAMA_PEERS)}")
    llama = [p for p in peers if p in LLAMA_PEERS]
    if len(llama) > 1:
        raise SystemExit(f"one llama.cpp peer per run, not {llama}: run the bench once for each")
    peers = [p for p in peers if p not in LLAMA_PEERS]
    args.out.mkdir(parents=True, exist_ok=True)
    args.raw_logs = raw_logs_dir(args)
    prompts = load_prompts(args)
    loads = loads_of(args)
    if llama:
        check_llamacpp_run(prompts, loads)
    peer_name = llama[0] if llama else None
    with target(args) as base_url, llamacpp_server(args, peer_name) as peer:
        model, measurements = asyncio.run(sweep(args, base_url, prompts, loads, peer))
    rows = [row for m in measurements for row in stats.measurement_rows(m)]
    server_rows = stats.median_rows(rows)
    for row in server_rows:
        row["ratio_vs_server_plain"] = row["speedup_vs_plain"]
    requests = request_records(measurements)
    write_outputs(args, model, server_rows, [], requests)
    if not peers:
        return 0
    try:
        peer_rows = run_peers(args, peers, prompts)
    except (subprocess.CalledProcessError, OSError) as exc:
        log(f"peers failed ({exc}); the server's results above stand")
        return 1
    stats.add_server_ratios(peer_rows, requests)
    write_outputs(args, model, server_rows, peer_rows, requests)
    return 0


def raw_logs_dir(args: argparse.Namespace) -> Path:
    """Where requests.jsonl and the servers' logs go: --raw-logs, else a fresh folder in the user's
    cache (never the repository: they are large and not results)."""
    if args.raw_logs is not None:
        return Path(args.raw_logs)
    from engine.model.bundled import cache_dir

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return cache_dir() / "bench-logs" / f"{Path(args.out).resolve().name}-{stamp}"


def check_llamacpp_run(prompts: dict[str, list[Prompt]], loads: list[Load]) -> None:
    if not any(load.concurrency == 1 for load in loads):
        raise SystemExit("the llama.cpp peer runs at concurrency 1: include 1 in --concurrency")
    schema = [c for c, ps in prompts.items() if any(p.response_format for p in ps)]
    if schema:
        raise SystemExit(f"the llama.cpp peer does not take JSON schemas: drop {schema}")


@dataclass(frozen=True)
class RunningPeer:
    server: llamacpp.PeerServer
    url: str


@contextlib.contextmanager
def llamacpp_server(args: argparse.Namespace, name: str | None) -> Iterator[RunningPeer | None]:
    """The llama.cpp peer `name` on the config's GGUF file, beside the server under test, for the
    whole sweep."""
    if name is None:
        yield None
        return
    server = llama_peer_server(args, name)
    log_path = args.raw_logs / f"{name}.log"
    with llamacpp.launched_llamacpp(server, log_path, args.launch_timeout) as url:
        port = int(url.rsplit(":", 1)[1])
        args.llamacpp = {
            "peer": name, "gguf": str(server.model_path), "threads": server.n_threads,
            "command": shlex.join(server.command(port)), "build": server.build_info(log_path),
        }  # fmt: skip
        yield RunningPeer(server, url)


def llama_peer_server(args: argparse.Namespace, name: str) -> llamacpp.PeerServer:
    """What to launch for the llama.cpp peer `name`, from the flags and the launch config."""
    binary = check_llama_peer(args, name)
    cfg = config_settings(args.launch)
    spec = args.peer_model or serve_flag(args, "--model") or cfg.get("model")
    if not spec:
        raise SystemExit("the llama.cpp peer needs --peer-model FILE.gguf (or --launch CONFIG)")
    model = llamacpp.gguf_file(str(spec))
    threads = int(args.peer_threads or cfg.get("num_threads") or cpu_info().physical_cores)
    n_ctx = int(cfg.get("max_model_len") or 4096)
    if binary is None:
        return llamacpp.LlamaCppServer(model, threads, n_ctx)
    draft = peer_draft_gguf(args, cfg) if name == "llama-server-draft" else None
    k = int(args.peer_k or cfg.get("num_speculative_tokens") or 3)
    return llama_server.LlamaServer(binary, model, threads, n_ctx, name, draft, draft_max=k)


def check_llama_peer(args: argparse.Namespace, name: str) -> Path | None:
    """Stops unless the peer `name` can run here; the llama-server binary it runs, if it is one."""
    if name == llamacpp.NAME:
        if not llamacpp.installed():
            raise SystemExit(llamacpp.INSTALL_HINT)
        return None
    binary = Path(args.llama_server or llama_server.default_binary())
    llama_server.check_binary(binary)
    spec_type = llama_server.SPEC_TYPES[name]
    if spec_type is not None:
        llama_server.check_spec_type(binary, spec_type)
    return binary


def peer_draft_gguf(args: argparse.Namespace, cfg: dict[str, Any]) -> Path:
    draft = args.peer_draft_model or serve_flag(args, "--draft-model") or cfg.get("draft_model")
    if not draft:
        raise SystemExit("llama-server-draft needs --peer-draft-model FILE.gguf (or a config's)")
    return llamacpp.gguf_file(str(draft))


async def sweep(
    args: argparse.Namespace,
    base_url: str,
    prompts: dict[str, list[Prompt]],
    loads: list[Load],
    running: RunningPeer | None = None,
) -> tuple[str, list[Measurement]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        httpx.AsyncClient(base_url=base_url, limits=limits, timeout=None) as client,
        httpx.AsyncClient(base_url=running.url if running else base_url, timeout=None) as pc,
    ):
        model = args.model or await first_model(client)
        settings = RequestSettings(
            model, args.max_tokens, args.temperature, args.ignore_eos, args.request_timeout
        )
        peer = llamacpp.peer_target(pc, running.server) if running else None
        name = peer.name if peer else None
        total = args.repeats * sum(
            requests_per_measurement(ps, load, name) for ps in prompts.values() for load in loads
        )
        with tqdm(total=total, desc="requests", unit="req") as bar:
            runner = Runner(client, settings, args.max_concurrency, bar, args.control, peer)
            if not args.no_warmup:
                await runner.warmup(next(iter(prompts.values()))[0])
            measurements = []
            if not args.no_prime:
                for category, plist in prompts.items():
                    bar.set_postfix_str(f"priming the prefix cache: {category}")
                    await runner.prime(plist)
            for repeat in range(args.repeats):
                for category, plist in prompts.items():
                    for load in loads:
                        bar.set_postfix_str(f"repeat {repeat + 1} {category} {load.label}")
                        m = await runner.measure(category, plist, load, repeat, args.seed)
                        measurements.append(m)
    return model, measurements


async def first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models", timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def request_records(measurements: list[Measurement]) -> list[Row]:
    records = []
    for m in measurements:
        for run in m.runs.values():
            for result in run.results:
                key = {"category": m.category, "load": m.load.label, "repeat": m.repeat}
                records.append({**key, **asdict(result)})
    return records


# ---------------------------------------------------------------- peers


def config_settings(path: Path | None) -> dict[str, Any]:
    """The launch config as the server reads it (file, then SPECSERVE_* variables)."""
    if path is None:
        return {}
    from server.settings import Settings

    return Settings.load(path).model_dump()


def serve_flag(args: argparse.Namespace, flag: str) -> str | None:
    words = shlex.split(args.serve_args)
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def peer_job(
    args: argparse.Namespace, modes: list[str], prompts: dict[str, list[Prompt]]
) -> PeerJob:
    cfg = config_settings(args.launch)
    model = args.peer_model or serve_flag(args, "--model") or cfg.get("model")
    if not model:
        raise SystemExit("peers need --peer-model (or --launch with a config naming the model)")
    draft = args.peer_draft_model or serve_flag(args, "--draft-model") or cfg.get("draft_model")
    k = args.peer_k or cfg.get("num_speculative_tokens") or 4
    threads = args.peer_threads or cfg.get("num_threads")
    return PeerJob(
        model=str(model),
        draft_model=str(draft) if draft else None,
        dtype=str(args.dtype or serve_flag(args, "--dtype") or cfg.get("dtype") or "bfloat16"),
        device=str(args.device or serve_flag(args, "--device") or cfg.get("device") or "cpu"),
        num_threads=int(threads) if threads else None,
        modes=tuple(modes),
        prompts={c: [asdict(p) for p in ps] for c, ps in prompts.items()},
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        repeats=args.repeats,
        num_speculative_tokens=int(k),
    )


def run_peers(
    args: argparse.Namespace, modes: list[str], prompts: dict[str, list[Prompt]]
) -> list[Row]:
    if "hf" not in modes:
        modes = ["hf", *modes]  # the peers' own baseline for their speedup
    if args.peer_num_prompts is not None:
        prompts = {c: ps[: args.peer_num_prompts] for c, ps in prompts.items()}
    job = peer_job(args, modes, prompts)
    log(f"peers {', '.join(modes)} on {job.model} ({job.dtype}, {job.device}), concurrency 1")
    records = run_peers_subprocess(job, args.raw_logs / "peers")
    return stats.peer_rows(records)


# ---------------------------------------------------------------- outputs


def command_line(args: argparse.Namespace) -> str:
    """The flags this run was given, as one reproducible command."""
    words = ["specserve", "bench"]
    for key, value in vars(args).items():
        if key in ("func", "command", "llamacpp") or value in (None, False, "", []):
            continue
        flag = "--" + key.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        for v in values:
            words += [flag] if v is True else [flag, str(v)]
    return " ".join(shlex.quote(w) for w in words)


def server_meta(args: argparse.Namespace) -> dict[str, Any]:
    """The launched server's settings that shape the result (nothing for --base-url)."""
    cfg = config_settings(args.launch)
    keys = ("model", "draft_model", "speculative_method", "num_speculative_tokens", "dtype")
    found = {key: cfg.get(key) for key in (*keys, "device", "num_threads") if key in cfg}
    found["target_model"] = found.pop("model", None)
    for flag in ("device", "dtype"):
        found[flag] = getattr(args, flag) or serve_flag(args, f"--{flag}") or found.get(flag)
    return found if args.launch else {}


def llamacpp_meta(args: argparse.Namespace) -> dict[str, Any]:
    info = getattr(args, "llamacpp", None) or {}
    return {"llamacpp_" + k: v for k, v in info.items()}


def write_outputs(
    args: argparse.Namespace, model: str, rows: list[Row], peers: list[Row], requests: list[Row]
) -> None:
    out: Path = args.out
    (out / "results.json").write_text(json.dumps(rows + peers, indent=1))
    args.raw_logs.mkdir(parents=True, exist_ok=True)
    with (args.raw_logs / "requests.jsonl").open("w") as f:
        for rec in requests:
            f.write(json.dumps(rec) + "\n")
    meta = {
        "command": command_line(args),
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "repeats": args.repeats,
        "num_prompts": args.num_prompts,
        **({"control": "A/A: both modes decode plainly"} if args.control else {}),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        **cpu_info().summary(),
        **server_meta(args),
        **llamacpp_meta(args),
        "raw_logs": str(args.raw_logs),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    write_report(out / "report.md", rows, peers, meta)
    plots = write_plots(out, rows, peers, requests)
    log(f"wrote {out / 'results.json'}, {out / 'report.md'}, {', '.join(p.name for p in plots)}")
