"""The engine thread: one thread does all of the engine's torch work, from loading to the last step.

Why one thread: torch's CPU ops run in parallel through GNU OpenMP (libgomp), and libgomp keeps a
thread pool per calling thread. A process that loads the model on one thread and steps it on
another holds two pools, N - 1 workers each. libgomp counts every pool's workers, and when that
count passes the number of CPUs it throttles its spin-wait from 300,000 iterations to 100
(`do_spin` in libgomp's `config/linux/wait.h`): between two parallel regions a worker then sleeps
on a futex and must be woken by a system call, once per region, and a decode step enters
thousands of them (every elementwise op, every GEMM, in every layer). Measured on 2 cores: the
same engine stepped from a second thread decoded at 0.65-0.7x the speed of the thread that loaded
it. With loading, calibration and every step on this one thread, the process holds one pool of
`num_threads - 1` workers and they spin between regions as they should.

The HTTP side never runs a torch op: it sends commands and receives outputs (engine.core.async_engine).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class EngineThread(threading.Thread, Generic[T]):
    """Builds its object with `build()` on itself, then runs the loop handed to `run_loop`."""

    def __init__(self, build: Callable[[], T], name: str = "specserve-engine") -> None:
        super().__init__(name=name, daemon=True)
        self._build = build
        self._built = threading.Event()
        self._go = threading.Event()
        self._loop: Callable[[], None] | None = None
        self._value: T | None = None
        self._error: BaseException | None = None

    def start_and_build(self) -> T:
        """Start the thread, wait while it builds, and return what it built (or raise its error)."""
        self.start()
        self._built.wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def run_loop(self, loop: Callable[[], None]) -> None:
        """Hand the built thread its loop; it returns when the loop does."""
        self._loop = loop
        self._go.set()

    def cancel(self) -> None:
        """Let a thread that never got a loop exit."""
        self._go.set()

    def run(self) -> None:
        _name_os_thread(self.name)
        try:
            self._value = self._build()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            self._error = exc
            return
        finally:
            self._built.set()
        self._go.wait()
        if self._loop is not None:
            self._loop()


def _name_os_thread(name: str) -> None:
    """Give the OS thread the Python name (`top -H` shows it). The OpenMP workers this thread
    starts inherit it, so the engine's whole pool is visible by name in /proc/<pid>/task."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
