"""What a forward pass costs as a function of the rows it computes, per model.

Whether a draft pays depends on what its verify row costs, and that is not one number. On a GPU the
first few extra rows of a decode step are nearly free (the step reads every weight once whatever M
is); on CPU int4/int8 kernels work in tiles of rows (on this project's AVX2 host a step of 5-8 rows
costs what 8 do and about twice what 4 do), so the rows that fill a tile are free and the next one
costs a whole tile. No shape is assumed here: each model's curve is measured at start-up
(`calibrate`), then every forward the engine runs refreshes the point it hit.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable

from engine.model_runner import ForwardInput, ModelRunner

log = logging.getLogger("specserve.engine")

WEIGHT = 0.2  # of a new measurement in a point's running mean
_CONTEXT = 32  # tokens in the cache behind the calibration rows, as a short decode would have


class CostCurve:
    """Seconds of one forward against its number of rows: measured points, interpolated between
    them, and extended proportionally past the last one."""

    def __init__(self) -> None:
        self.points: dict[int, float] = {}  # rows -> running mean of seconds
        self._rows: list[int] = []  # sorted keys of points

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0:
            return
        if rows not in self.points:
            bisect.insort(self._rows, rows)
            self.points[rows] = seconds
            return
        self.points[rows] += WEIGHT * (seconds - self.points[rows])

    @property
    def known(self) -> bool:
        return bool(self._rows)

    def seconds(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        if not self._rows:
            return float(rows)  # nothing measured: every row a full unit, so no draft is free
        at = bisect.bisect_left(self._rows, rows)
        if at < len(self._rows) and self._rows[at] == rows:
            return self.points[rows]
        if at == 0:
            return self.points[self._rows[0]]
        lo = self._rows[at - 1]
        if at == len(self._rows):
            return self.points[lo] * rows / lo
        hi = self._rows[at]
        t_lo, t_hi = self.points[lo], self.points[hi]
        return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)

    def summary(self, rows: Iterable[int] = (1, 2, 4, 5, 8, 16)) -> str:
        return ", ".join(f"{m} rows {1000 * self.seconds(m):.1f} ms" for m in rows)


class StepCosts:
    """The target's and the draft's cost curves, and the step's own time outside the forwards."""

    def __init__(self) -> None:
        self.target = CostCurve()
        self.draft = CostCurve()
        self.overhead = 0.0  # seconds of a step outside the forwards: scheduling, verification

    def observe_overhead(self, seconds: float) -> None:
        self.overhead += WEIGHT * (max(0.0, seconds) - self.overhead)


def calibration_rows(max_rows: int) -> list[int]:
    """Every row count up to 16 (where kernels tile), then a sparser ladder up to max_rows."""
    ladder = [*range(1, 17), 24, 32, 48, 64, 96, 128]
    return [m for m in ladder if m <= max(1, max_rows)]


def calibrate(curve: CostCurve, runner: ModelRunner, rows: list[int], num_blocks: int) -> None:
    """Time one forward at each row count (after a warm-up), on scratch K/V blocks. Call before
    any request runs: the blocks written here belong to no one yet."""
    block_size = runner.block_size
    started = time.perf_counter()
    for i, m in enumerate([rows[-1], *rows]):
        context = _CONTEXT if -(-(_CONTEXT + m) // block_size) <= num_blocks else 0
        blocks = -(-(context + m) // block_size)
        if blocks > num_blocks:
            continue
        ids = [(7 * j + 11) % runner.vocab_size for j in range(m)]
        inputs = [ForwardInput(ids, context, list(range(blocks)), m)]
        t0 = time.perf_counter()
        runner.forward(inputs)
        if i > 0:  # the first pass warms caches and allocators up
            curve.observe(m, time.perf_counter() - t0)
    log.info(
        "%s step cost, calibrated in %.1f s: %s",
        runner.loaded.name,
        time.perf_counter() - started,
        curve.summary(),
    )
