"""Adaptive speculation: speculate only where it measurably pays.

Whether drafting pays depends on the draft's cost, on how much of what it drafts the target keeps
(the text), and on load (a verify pass stops being nearly free once the batch makes it
compute-bound). None of that is assumed here. The policy measures the goodput of whole decode steps,
tokens emitted per second of step time (drafting, verification and acceptance included), separately
for steps with drafts and steps without, per batch-size bucket, and lets the better one run. Now and
then a step runs the other mode (EXPLORE_EVERY steps after the verdict changes, backing off to
MAX_EXPLORE_EVERY while it holds, since a try of the losing mode costs time), so the verdict follows
the text and the load as they change. Steps that carry prompt chunks are not measured: prefill would swamp the comparison.

Within a speculative step the draft's own confidence cutoff (draft_p_min) decides how many of the k
drafts it really proposes, so k is a ceiling, not a quota.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPLORE_EVERY = 16  # steps between tries of the losing mode, per bucket, while the verdict is new
MAX_EXPLORE_EVERY = 64  # a verdict that keeps holding is re-checked ever less often, up to this
DECAY = 0.9  # weight of the past in the running means


@dataclass
class RunningMean:
    """Exponentially weighted mean of tokens per second over steps (weighted by step time)."""

    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = DECAY * self.tokens + tokens
        self.seconds = DECAY * self.seconds + seconds

    @property
    def known(self) -> bool:
        return self.seconds > 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass
class Bucket:
    """Goodput with and without drafts for one range of batch sizes."""

    speculative: RunningMean = field(default_factory=RunningMean)
    plain: RunningMean = field(default_factory=RunningMean)
    verdict: bool = True  # speculate?
    interval: int = EXPLORE_EVERY  # steps between tries of the other mode
    countdown: int = EXPLORE_EVERY

    @property
    def speculation_wins(self) -> bool:
        return self.speculative.rate >= self.plain.rate


def bucket_of(batch_size: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, ...: batch sizes whose steps cost alike share a verdict."""
    return max(0, batch_size - 1).bit_length()


class SpeculationPolicy:
    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.buckets: dict[int, Bucket] = {}

    def choose_k(self, batch_size: int) -> int:
        """The drafts each request may get this step: k_max, or 0 where plain decoding wins."""
        bucket = self.buckets.setdefault(bucket_of(batch_size), Bucket())
        if not bucket.speculative.known:
            return self.k_max  # measure both first
        if not bucket.plain.known:
            return 0
        if bucket.speculation_wins != bucket.verdict:
            bucket.verdict = bucket.speculation_wins
            bucket.interval = bucket.countdown = EXPLORE_EVERY
        speculate = bucket.verdict
        bucket.countdown -= 1
        if bucket.countdown <= 0:  # try the other mode; the verdict held, so check less often
            speculate = not speculate
            bucket.interval = min(2 * bucket.interval, MAX_EXPLORE_EVERY)
            bucket.countdown = bucket.interval
        return self.k_max if speculate else 0

    def observe(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        """One decode-only step: its batch size, whether it drafted, tokens it emitted, its time."""
        bucket = self.buckets.setdefault(bucket_of(batch_size), Bucket())
        (bucket.speculative if speculated else bucket.plain).add(tokens, seconds)

    def verdicts(self) -> dict[int, bool]:
        """Bucket -> speculating? (for logs and tests)."""
        return {
            b: v.speculation_wins
            for b, v in self.buckets.items()
            if v.plain.known and v.speculative.known
        }
