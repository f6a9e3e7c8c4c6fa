"""What the engine asks of the device it runs on, in one place: wait for its queued work, how much
memory it has free, make it the current device of a thread, and time a forward.

On a CPU every call here is a no-op or a host measurement: work is done when the call returns.
On CUDA, kernels run asynchronously: a `perf_counter` around a forward measures its launches, not
its work, so timings synchronize (calibration) or read CUDA events (the engine's per-forward
timings, resolved once per step when the step's tokens come back to the host anyway).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# The CUDA-only work of this module is unrun until a GPU session runs scripts/gpu_check.sh.


def is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def host_syncs_free(device: torch.device | str) -> bool:
    """Whether reading a tensor on the host costs nothing more than the read: on a CPU the work
    is done when the op returns, so a loop may look at its results (and skip work by them); on a
    GPU each look makes the host wait for the device's queue, so hot loops keep results there."""
    return torch.device(device).type == "cpu"


def synchronize(device: torch.device | str) -> None:
    """Wait until the device has finished the work queued on it (a no-op on a CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(torch.device(device))


def mem_get_info(device: torch.device | str) -> tuple[int, int]:
    """(free, total) bytes of the device's memory: `cuda:1` asks GPU 1, never the current one."""
    if not is_cuda(device):
        raise ValueError(f"mem_get_info is for a CUDA device, not {device}")
    return torch.cuda.mem_get_info(torch.device(device))


def make_current(device: torch.device | str) -> None:
    """Make `device` this thread's current CUDA device (CUDA keeps one per thread): streams,
    events and collectives of a thread that runs steps then land on the engine's GPU."""
    if is_cuda(device):
        torch.cuda.set_device(torch.device(device).index or 0)  # bare "cuda": GPU 0, as torch


@dataclass(frozen=True)
class TimingMark:
    """Where a timed forward started: a host clock reading, or a recorded CUDA event."""

    host: float
    event: torch.cuda.Event | None = None


def start_timing(device: torch.device) -> TimingMark:
    if not is_cuda(device):
        return TimingMark(time.perf_counter())
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return TimingMark(time.perf_counter(), event)


def stop_timing(device: torch.device) -> TimingMark:
    return start_timing(device)


def elapsed_seconds(start: TimingMark, stop: TimingMark) -> float:
    """Seconds between two marks. CUDA: the device's own time between the events (waits for the
    later one: call once the step's results are on the host, and it costs nothing)."""
    if start.event is None or stop.event is None:
        return stop.host - start.host
    stop.event.synchronize()
    return start.event.elapsed_time(stop.event) / 1000.0


def drain_timings(
    timings: list[tuple[int, TimingMark, TimingMark]] | None,  # (rows, start, stop); None: off
) -> list[tuple[int, float]]:
    """(rows, seconds) of each recorded forward, the record emptied for the next step."""
    if not timings:
        return []
    taken = [(rows, elapsed_seconds(start, stop)) for rows, start, stop in timings]
    timings.clear()
    return taken
