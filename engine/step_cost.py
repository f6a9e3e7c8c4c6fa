"""What a forward pass costs as a function of the rows it computes, per model.

Whether a draft pays depends on what its verify row costs, and that is not one number. On a GPU the
first few extra rows of a decode step are nearly free (the step reads every weight once whatever M
is); on CPU int4/int8 kernels work in tiles of rows (on this project's AVX2 host a step of 5-8 rows
costs what 8 do and about twice what 4 do), so the rows that fill a tile are free and the next one
costs a whole tile. No shape is assumed here: each model's curve is measured at start-up
(`calibrate`), and every forward the engine runs then moves the curve's level, not its shape
(`CostCurve.track`): calibration measures every row count alike (one request, a short context),
while real steps carry many requests and long contexts, so a point refreshed by them alone would
make the row counts next to it look free (measured: 16 rows refreshed to 1.0 s beside a
calibrated 1.3 s at 24 rows priced 8 more verify rows at nothing).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterable

from engine.model_runner import ForwardInput, ModelRunner

log = logging.getLogger("specserve.engine")

WEIGHT = 0.2  # of a new measurement in a running mean (a point's, or the curve's level)
_CONTEXT = 32  # tokens in the cache behind the calibration rows, as a short decode would have


class CostCurve:
    """Seconds of one forward against its number of rows: measured points, interpolated between
    them, extended proportionally past the last one, times a level learned from the forwards the
    engine runs. A forward is never taken to cost more than one of more rows, so one noisy
    measurement cannot make a row count look dear (and then never be tried to correct it)."""

    def __init__(self) -> None:
        self.points: dict[int, float] = {}  # rows -> running mean of seconds
        self._rows: list[int] = []  # sorted keys of points
        self._cost: list[float] = []  # per key: min of its mean and every larger key's
        self.scale = 1.0  # real forwards' time over the measured shape's (running mean)
        # From this many rows on a forward is a prompt (one logit; a draft's catch-up): measured
        # as such, and left out of the level, which real decode steps set (their long contexts
        # cost a 0.5B draft 40% over calibration's, a prompt forward no more than measured).
        self.prompt_rows_from: int | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0:
            return
        if rows not in self.points:
            bisect.insort(self._rows, rows)
            self.points[rows] = seconds
        else:
            self.points[rows] += WEIGHT * (seconds - self.points[rows])
        self._cost = [self.points[m] for m in self._rows]
        for i in range(len(self._cost) - 2, -1, -1):
            self._cost[i] = min(self._cost[i], self._cost[i + 1])

    def track(self, rows: int, seconds: float) -> None:
        """A forward the engine ran: it moves the curve's level, not the point it hit. Forwards
        beyond the measured rows (long prompt chunks) have another shape and are left out."""
        if self._rows and 0 < rows <= self._rows[-1] and not self.is_prompt(rows):
            ratio = seconds / max(self._shape(rows), 1e-9)
            self.scale += WEIGHT * (ratio - self.scale)

    @property
    def known(self) -> bool:
        return bool(self._rows)

    def seconds(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        if not self._rows:
            return float(rows)  # nothing measured: every row a full unit, so no draft is free
        return self._shape(rows) * (1.0 if self.is_prompt(rows) else self.scale)

    def is_prompt(self, rows: int) -> bool:
        return self.prompt_rows_from is not None and rows >= self.prompt_rows_from

    def _shape(self, rows: int) -> float:
        at = bisect.bisect_left(self._rows, rows)
        if at < len(self._rows) and self._rows[at] == rows:
            return self._cost[at]
        if at == 0:
            return self._cost[0]
        lo = self._rows[at - 1]
        if at == len(self._rows):
            return self._cost[-1] * rows / lo
        hi = self._rows[at]
        t_lo, t_hi = self._cost[at - 1], self._cost[at]
        return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)

    def summary(self, rows: Iterable[int] = (1, 2, 4, 5, 8, 16)) -> str:
        return ", ".join(f"{m} rows {1000 * self.seconds(m):.1f} ms" for m in rows)


class StepCosts:
    """The target's and the draft's cost curves, and the time a step spends outside them."""

    def __init__(self) -> None:
        self.target = CostCurve()
        self.draft = CostCurve()
        self.overhead = 0.0  # seconds of a step outside the forwards: scheduling, verification
        self.draft_overhead = 0.0  # seconds per draft forward outside it: sampling the drafts

    def observe_step(
        self, seconds: float, target_seconds: float, draft_seconds: list[float], propose: float
    ) -> None:
        """One step: its wall time, its target forwards' time, each draft forward's time, and the
        proposers' whole time (draft forwards included)."""
        if draft_seconds:
            per_forward = max(0.0, propose - sum(draft_seconds)) / len(draft_seconds)
            self.draft_overhead += WEIGHT * (per_forward - self.draft_overhead)
        drafting = sum(draft_seconds) + len(draft_seconds) * self.draft_overhead
        outside = max(0.0, seconds - target_seconds - drafting)
        self.overhead += WEIGHT * (outside - self.overhead)


def calibration_rows(max_rows: int) -> list[int]:
    """Every row count up to 16 (where kernels tile), then a sparser ladder up to max_rows."""
    ladder = [*range(1, 17), 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    return [m for m in ladder if m <= max(1, max_rows)]


def calibrate(
    curve: CostCurve,
    runner: ModelRunner,
    rows: list[int],
    num_blocks: int,
    prompt_rows_from: int | None = None,
) -> None:
    """Time one forward at each row count (after a warm-up), on scratch K/V blocks. Call before
    any request runs: the blocks written here belong to no one yet.

    Each row is a token that needs its logits (decode and verify rows), except from
    `prompt_rows_from` rows on: forwards that large are prompts, which need one (the LM head over
    a 150k vocabulary costs a 0.5B draft as much as its layers do)."""
    block_size = runner.block_size
    curve.prompt_rows_from = prompt_rows_from
    started = time.perf_counter()
    warm_up = max(m for m in rows if not curve.is_prompt(m))
    for i, m in enumerate([warm_up, *rows]):
        context = _CONTEXT if -(-(_CONTEXT + m) // block_size) <= num_blocks else 0
        blocks = -(-(context + m) // block_size)
        if blocks > num_blocks:
            continue
        ids = [(7 * j + 11) % runner.vocab_size for j in range(m)]
        logits = 1 if curve.is_prompt(m) else m
        inputs = [ForwardInput(ids, context, list(range(blocks)), logits)]
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
