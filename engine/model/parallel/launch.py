"""Start a tensor-parallel group for `specserve serve`: rank 0 is the server's own process and
spawns ranks 1..N-1 as `python -m engine.model.parallel.worker` (or torchrun started them all).

Rank 0 watches its workers: one that exits takes the server down (503, then a non-zero exit)
instead of leaving a collective waiting forever.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from engine.config import EngineConfig
from engine.model.device import make_current
from engine.model.tensor_parallel import TensorParallel, set_tensor_parallel

log = logging.getLogger("specserve.parallel")
# Ranks wait for rank 0's next step as long as the server idles: no collective timeout.
IDLE_TIMEOUT_S = 10 * 365 * 24 * 3600


def rank_device(config: EngineConfig, rank: int) -> str:
    """cuda:N for rank r runs on cuda:N+r (a bare `cuda` on cuda:r); CPU ranks share the CPU."""
    if not config.device.startswith("cuda"):
        return config.device
    base = int(config.device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def init_group(
    config: EngineConfig, rank: int, init_method: str, device: str, timeout_s: int = IDLE_TIMEOUT_S
) -> TensorParallel:
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    make_current(device)  # this thread's CUDA device (a no-op on CPU)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=config.tensor_parallel_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    tp = TensorParallel(rank, config.tensor_parallel_size, config.model)
    set_tensor_parallel(tp)
    return tp


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher) set RANK and WORLD_SIZE."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


@dataclass
class TensorParallelGroup:
    """Rank 0's handle on the group: its workers (when it spawned them) and why it failed."""

    tp: TensorParallel
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    failed: str | None = None

    def watch(self, on_failure: Callable[[str], None]) -> None:
        threading.Thread(target=self._watch, args=(on_failure,), daemon=True).start()

    def _watch(self, on_failure: Callable[[str], None]) -> None:
        while self.failed is None:
            for rank, worker in enumerate(self.workers, start=1):
                if worker.poll() is not None and self.failed is None:
                    self.failed = f"tensor-parallel rank {rank} exited with {worker.returncode}"
                    log.error("%s; the server stops", self.failed)
                    on_failure(self.failed)
            time.sleep(0.2)

    def stop(self) -> None:
        """Tell the workers to stop (a normal shutdown) and reap them."""
        if self.failed is None:
            self.failed = "stopped"  # the watcher must not mistake a normal exit for a crash
            try:
                self.tp.lead("stop")
            except RuntimeError as exc:
                log.warning("stopping the tensor-parallel workers: %s", exc)
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()


def launch(config: EngineConfig, on_failure: Callable[[str], None]) -> TensorParallelGroup:
    """Rank 0: join (torchrun) or spawn the group; returns once every rank is connected."""
    device = rank_device(config, 0)
    if torchrun_rank() is not None:
        return TensorParallelGroup(init_group(config, 0, "env://", device))
    port = _free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    workers = [_spawn(config, rank, init_method) for rank in range(1, config.tensor_parallel_size)]
    group = TensorParallelGroup(
        TensorParallel(0, config.tensor_parallel_size, config.model), workers
    )
    group.watch(on_failure)
    group.tp = init_group(config, 0, init_method, device)
    log.info("tensor parallelism: %d ranks on %s", config.tensor_parallel_size, init_method)
    return group


def _spawn(config: EngineConfig, rank: int, init_method: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "engine.model.parallel.worker", "--model", config.model,
        "--device", config.device, "--rank-device", rank_device(config, rank),
        "--dtype", config.dtype, "--block-size", str(config.block_size),
        "--rank", str(rank), "--world-size", str(config.tensor_parallel_size),
        "--init-method", init_method, "--timeout-s", str(IDLE_TIMEOUT_S),
    ]  # fmt: skip
    if config.num_threads:
        cmd += ["--num-threads", str(config.num_threads)]
    worker = subprocess.Popen(cmd)
    log.info("started tensor-parallel rank %d (pid %d)", rank, worker.pid)
    return worker


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
