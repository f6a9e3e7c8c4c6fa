"""What a forward pass costs as a function of the rows it computes, per model.

Whether a draft pays depends on what its verify row costs, and that is not one number. On a GPU the
first few extra rows of a decode step are nearly free (the step reads every weight once whatever M
is); on CPU int4/int8 kernels work in tiles of rows, so the rows that fill a tile are cheap and the
next one can cost a whole tile. No shape is assumed here: each model's curve is measured at
start-up (`calibrate`, the median of a few rounds), and every forward the engine runs then
corrects it (`CostCurve.track`).

Two corrections, because calibration measures every row count alike (one request, a short context)
while real steps carry many requests and long contexts:
- the curve's level: the forwards drafts are weighed against (the target's plain decode steps,
  every draft forward) move one ratio of real time to calibrated time, and a row count the engine
  has not run is priced at the calibrated shape times that level;
- the row count it hit: each row count keeps its own record of that ratio, fading while the count
  goes unused (so it is measured again now and then); a count between two with records takes
  their ratios interpolated.
On this shared 2-core host one calibration put 4, 5 and 8 target rows at 331-335 ms, where real
forwards took ~170 and ~345: with the level alone, the planner took n-gram drafts at 4 requests as
free for the whole run, and they lost 17-21% (docs/BENCHMARKS.md, X8). Now the first forwards of
each wrongly cheap size correct it. Verify forwards leave the level alone: were it set by them, a
plain step would be priced like a drafting one, and a loss would look like none.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

from engine.model import device as devices
from engine.model.runner import ForwardInput, ModelRunner

log = logging.getLogger("specserve.engine")

WEIGHT = 0.2  # of a new measurement in a running mean (a ratio, or a calibrated point)
SEEN_PRIOR = 0.5  # forwards' worth of the curve's level behind one row count's own ratio
SEEN_DECAY = 0.995  # per tracked forward: a row count's own record fades unless it is run again
CALIBRATION_ROUNDS = 3  # rounds over the tiled rows (1..16); their median is the point
_TILED_ROWS = 16
_CONTEXT = 32  # tokens in the cache behind the calibration rows, as a short decode would have


@dataclass
class _Seen:
    """Real forwards of one row count: how many (decayed), and their time over the calibrated."""

    weight: float
    ratio: float


class CostCurve:
    """Seconds of one forward against its number of rows: calibrated points, interpolated between
    them, extended proportionally past the last one, each times what real forwards measured of it
    (`ratio`). A forward is never taken to cost more than one of more rows, so one noisy
    measurement cannot make a row count look dear (and then never be tried to correct it)."""

    def __init__(self) -> None:
        self.points: dict[int, float] = {}  # rows -> calibrated seconds (running mean)
        self.scale = 1.0  # the level: real forwards' time over the calibrated (running mean)
        self.seen: dict[int, _Seen] = {}  # rows -> real forwards of exactly that many rows
        # From this many rows on a forward is a prompt (one logit; a draft's catch-up): measured
        # as such, and left out of the corrections, which real decode steps set (their long
        # contexts cost a 0.5B draft 40% over calibration's, a prompt forward no more than measured).
        self._prompt_rows_from: int | None = None
        self._calibrated: tuple[list[int], list[float]] = ([], [])  # sorted rows, enveloped seconds
        self._priced: tuple[list[int], list[float]] = ([], [])  # the same, times each ratio

    def observe(self, rows: int, seconds: float) -> None:
        """A calibration measurement."""
        if rows <= 0:
            return
        old = self.points.get(rows)
        self.points[rows] = seconds if old is None else old + WEIGHT * (seconds - old)
        keys = sorted(self.points)
        self._calibrated = (keys, _envelope([self.points[m] for m in keys]))
        self._reprice()

    def track(self, rows: int, seconds: float, sets_level: bool = True) -> None:
        """A forward the engine ran. Forwards beyond the calibrated rows (long prompt chunks) and
        prompt forwards have another shape and are left out. `sets_level`: False for a target
        forward that verified drafts. The level must come from the forwards drafts are weighed
        against: were it set by verify forwards alone, a plain step would be priced like a
        drafting one, never run, and so never measured."""
        keys = self._calibrated[0]
        if not keys or rows <= 0 or rows > keys[-1] or self.is_prompt(rows):
            return
        ratio = seconds / max(_interpolate(*self._calibrated, rows), 1e-9)
        if sets_level:
            self.scale += WEIGHT * (ratio - self.scale)
        for other in self.seen.values():
            other.weight *= SEEN_DECAY
        seen = self.seen.setdefault(rows, _Seen(0.0, ratio))
        seen.ratio += WEIGHT * (ratio - seen.ratio)
        seen.weight += 1.0
        self._reprice()

    @property
    def known(self) -> bool:
        return bool(self.points)

    def seconds(self, rows: int) -> float:
        if rows <= 0:
            return 0.0
        if not self.points:
            return float(rows)  # nothing measured: every row a full unit, so no draft is free
        return _interpolate(*self._priced, rows)

    def ratio(self, rows: int) -> float:
        """Real time over calibrated time at this row count: its own forwards' record, behind
        SEEN_PRIOR forwards at the level. A row count not run lies between two that were: their
        ratios interpolated (5..7 rows between a plain step of 4 and a drafting one of 8); past
        them, the level."""
        if self.is_prompt(rows):
            return 1.0
        seen = self.seen.get(rows)
        if seen is not None:
            return (seen.weight * seen.ratio + SEEN_PRIOR * self.scale) / (seen.weight + SEEN_PRIOR)
        below = max((m for m in self.seen if m < rows), default=None)
        above = min((m for m in self.seen if m > rows), default=None)
        if below is None or above is None:
            return self.scale
        lo, hi = self.ratio(below), self.ratio(above)
        return lo + (hi - lo) * (rows - below) / (above - below)

    @property
    def prompt_rows_from(self) -> int | None:
        return self._prompt_rows_from

    @prompt_rows_from.setter
    def prompt_rows_from(self, rows: int | None) -> None:
        self._prompt_rows_from = rows
        self._reprice()

    def is_prompt(self, rows: int) -> bool:
        return self._prompt_rows_from is not None and rows >= self._prompt_rows_from

    def summary(self, rows: Iterable[int] = (1, 2, 4, 5, 8, 16)) -> str:
        return ", ".join(f"{m} rows {1000 * self.seconds(m):.1f} ms" for m in rows)

    def _reprice(self) -> None:
        keys, calibrated = self._calibrated
        if not keys:
            return
        rows = sorted({*keys, *(m for m in self.seen if m <= keys[-1])})
        cost = [_interpolate(keys, calibrated, m) * self.ratio(m) for m in rows]
        self._priced = (rows, _envelope(cost))


def _envelope(cost: list[float]) -> list[float]:
    """Each point capped by every later one: never dearer than a forward of more rows."""
    out = list(cost)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def _interpolate(rows: list[int], cost: list[float], m: int) -> float:
    """Linear between the points, the first one below them, proportional past the last."""
    at = bisect.bisect_left(rows, m)
    if at < len(rows) and rows[at] == m:
        return cost[at]
    if at == 0:
        return cost[0]
    lo = rows[at - 1]
    if at == len(rows):
        return cost[-1] * m / lo
    hi = rows[at]
    return cost[at - 1] + (cost[at] - cost[at - 1]) * (m - lo) / (hi - lo)


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
    rounds: int = CALIBRATION_ROUNDS,
) -> None:
    """Time forwards at each row count (after a warm-up), on scratch K/V blocks. Call before any
    request runs: the blocks written here belong to no one yet.

    The tiled rows (up to 16, where one more row may cost a tile) are measured in `rounds` rounds,
    every other one in reverse order, and each point is their median: a burst of load from a
    neighbour on a shared host then moves one round, not the shape. Larger row counts, each a
    second or more, are measured once; real forwards correct them as they run.

    Each row is a token that needs its logits (decode and verify rows), except from
    `prompt_rows_from` rows on: forwards that large are prompts, which need one (the LM head over
    a 150k vocabulary costs a 0.5B draft as much as its layers do)."""
    curve.prompt_rows_from = prompt_rows_from
    started = time.perf_counter()
    tiled = [m for m in rows if m <= _TILED_ROWS and not curve.is_prompt(m)]
    order = list(rows)
    for r in range(1, rounds):
        order += tiled[::-1] if r % 2 else tiled
    _time_forward(runner, curve, max(m for m in rows if not curve.is_prompt(m)), num_blocks)
    samples: dict[int, list[float]] = {}
    for m in order:
        seconds = _time_forward(runner, curve, m, num_blocks)
        if seconds is not None:
            samples.setdefault(m, []).append(seconds)
    for m, times in samples.items():
        curve.observe(m, statistics.median(times))
    log.info(
        "%s step cost, calibrated in %.1f s: %s",
        runner.loaded.name,
        time.perf_counter() - started,
        curve.summary(),
    )


def _time_forward(runner: ModelRunner, curve: CostCurve, m: int, num_blocks: int) -> float | None:
    """Seconds of one forward of m rows behind a short context; None where the blocks lack room."""
    context = _CONTEXT if -(-(_CONTEXT + m) // runner.block_size) <= num_blocks else 0
    blocks = -(-(context + m) // runner.block_size)
    if blocks > num_blocks:
        return None
    ids = [(7 * j + 11) % runner.vocab_size for j in range(m)]
    logits = 1 if curve.is_prompt(m) else m
    inputs = [ForwardInput(ids, context, list(range(blocks)), logits)]
    # On a GPU the forward only queues kernels: time from an idle device to its finished work.
    devices.synchronize(runner.device)
    t0 = time.perf_counter()
    runner.forward(inputs)
    devices.synchronize(runner.device)
    return time.perf_counter() - t0
