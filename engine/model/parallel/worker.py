"""A tensor-parallel rank other than 0: load this rank's shard of the target, then run the
operations rank 0 leads (allocate the KV pool, forward a step) until it says stop.

Started by `launch.py` as `python -m engine.model.parallel.worker ...`, or by torchrun through
`specserve serve` on every rank but 0. It exits when rank 0 goes away (its parent dies or a
collective fails), so a crashed server never leaves ranks behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import threading
import time

import torch

from engine.config import EngineConfig
from engine.model.loader import load_model
from engine.model.parallel.launch import init_group, rank_device
from engine.model.runner import ModelRunner
from engine.model.tensor_parallel import TensorParallel, set_tensor_parallel

log = logging.getLogger("specserve.parallel")
_OPS = ("allocate_kv_cache", "forward")


def run_worker(config: EngineConfig, tp: TensorParallel, device: str) -> int:
    # Rank 0 leads the shutdown (Ctrl-C and torchrun signal every rank); a worker ends on its
    # "stop", when its parent dies, or when a collective fails.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    set_tensor_parallel(tp)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    runner = ModelRunner(load_model(config.model), device, config.dtype, config.block_size)
    log.info("tensor-parallel rank %d/%d ready on %s", tp.rank, tp.world_size, device)
    while True:
        op, args = tp.follow()
        if op == "stop":
            return 0
        if op == "forward":
            (inputs,) = args
            # Only rank 0 samples: skip the (replicated, vocabulary-wide) lm_head here.
            args = ([dataclasses.replace(i, num_logits=0) for i in inputs],)
        elif op not in _OPS:
            raise RuntimeError(f"rank {tp.rank}: unknown operation {op!r} from rank 0")
        getattr(runner, op)(*args)


def torchrun_worker(config: EngineConfig, rank: int) -> int:
    """A rank other than 0 under torchrun: `specserve serve` runs the worker loop instead."""
    device = rank_device(config, int(os.environ.get("LOCAL_RANK", rank)))
    return run_worker(config, init_group(config, rank, "env://", device), device)


def _exit_with_parent() -> None:
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    for flag in ("--model", "--device", "--dtype", "--init-method", "--rank-device"):
        p.add_argument(flag, required=True)
    for flag in ("--block-size", "--rank", "--world-size", "--timeout-s"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--num-threads", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_threads=args.num_threads, tensor_parallel_size=args.world_size,
    )  # fmt: skip
    tp = init_group(config, args.rank, args.init_method, args.rank_device, args.timeout_s)
    try:
        return run_worker(config, tp, args.rank_device)
    except Exception as exc:  # rank 0 went away, or this rank failed: either way, stop
        log.error("tensor-parallel rank %d stops: %s", args.rank, exc)
        return 1


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    os._exit(code)  # skip gloo's teardown, which aborts when a peer is already gone
