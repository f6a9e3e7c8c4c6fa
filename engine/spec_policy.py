"""Adaptive speculation: choose each step's k from measured costs and measured acceptance.

Speculation pays only while the target passes it saves outweigh what drafting and the longer verify
cost. With per-token acceptance rate a, k drafts yield E(k) = (1 - a^(k+1)) / (1 - a) tokens per
verify pass. A step over a batch of B requests costs about

    k * draft(B) + target(B * (k + 1))        (both affine in tokens, fitted online)

so the policy picks the k in [0, k_max] with the most expected tokens per second for the batch. As the
batch grows the verify pass stops being memory-bound, target() grows with tokens, and k falls to 0:
no over-speculation under load. k = 0 steps still probe with k = 1 now and then, so a request whose
text turns predictable gets speculation back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

PROBE_EVERY = 8  # steps between k = 1 probes while speculation is judged unprofitable
DECAY = 0.9  # weight of the past in the running estimates


@dataclass
class AffineCost:
    """seconds ~ fixed + per_token * tokens, by exponentially weighted least squares."""

    s1: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = DECAY
        self.s1 = d * self.s1 + 1
        self.sx = d * self.sx + tokens
        self.sy = d * self.sy + seconds
        self.sxx = d * self.sxx + tokens * tokens
        self.sxy = d * self.sxy + tokens * seconds

    @property
    def known(self) -> bool:
        return self.s1 >= 3

    def __call__(self, tokens: float) -> float:
        mean_x, mean_y = self.sx / self.s1, self.sy / self.s1
        var = self.sxx / self.s1 - mean_x * mean_x
        slope = max(0.0, (self.sxy / self.s1 - mean_x * mean_y) / var) if var > 1e-9 else 0.0
        if var <= 1e-9:  # one batch shape seen so far: assume the cost does not grow with tokens
            return mean_y
        return max(0.0, mean_y - slope * mean_x) + slope * tokens


@dataclass
class AcceptanceEstimate:
    """Per-request acceptance rate from (accepted run, rejected?) observations, recent ones weighted."""

    accepted: float = 0.0
    rejected: float = 0.0

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (1 if num_accepted < num_draft else 0)

    @property
    def rate(self) -> float:
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)  # Laplace: 0.5 when unknown


def expected_tokens(rate: float, k: int) -> float:
    """Tokens per verify pass with k drafts (accepted prefix plus the target's own token)."""
    if rate >= 1.0:
        return k + 1.0
    return (1 - rate ** (k + 1)) / (1 - rate)


class SpeculationPolicy:
    def __init__(self, k_max: int, uses_draft_model: bool) -> None:
        self.k_max = k_max
        self.target_cost = AffineCost()
        self.draft_cost = AffineCost() if uses_draft_model else None
        self.steps_without = 0
        self.last_k = k_max

    def observe_target(self, tokens: int, seconds: float) -> None:
        self.target_cost.observe(tokens, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if self.draft_cost is not None:
            self.draft_cost.observe(tokens, seconds)

    def choose_k(self, rates: Seq[float], other_tokens: int) -> int:
        """k for this step: rates of the decoding requests; other_tokens = prefill tokens riding along."""
        if not rates or not self._calibrated():
            return self.k_max
        best = max(range(self.k_max + 1), key=lambda k: self._goodput(k, rates, other_tokens))
        if best == 0:
            self.steps_without += 1
            best = 1 if self.steps_without % PROBE_EVERY == 0 else 0
        else:
            self.steps_without = 0
        self.last_k = best
        return best

    def _calibrated(self) -> bool:
        return self.target_cost.known and (self.draft_cost is None or self.draft_cost.known)

    def _goodput(self, k: int, rates: Seq[float], other_tokens: int) -> float:
        batch = len(rates)
        seconds = self.target_cost(other_tokens + batch * (k + 1))
        if self.draft_cost is not None and k > 0:
            # The first draft forward also catches up (about 2 tokens a request); the rest feed one.
            seconds += self.draft_cost(2 * batch) + (k - 1) * self.draft_cost(batch)
        return sum(expected_tokens(rate, k) for rate in rates) / seconds
