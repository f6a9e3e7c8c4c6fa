"""Adaptive speculation: speculate only where it measurably pays.

Speculation pays while the target passes it saves outweigh what drafting and the longer verify pass
cost. Nothing here is assumed: the policy fits the target's and the draft's forward cost online
(seconds, affine in tokens, from the steps the engine runs) and keeps, per request, running means of
what a speculative step yields (tokens emitted per verify pass) and drafts. Each step it compares,
for the running batch,

    speculative: sum(tokens per step) / (draft forwards * draft(B) + target(B + drafted tokens))
    plain:       B / target(B)

and lets requests draft up to k only if the first is larger. Within a step the draft's own
confidence cutoff (draft_p_min) decides how many of the k it really proposes. As the batch grows the
verify pass stops being memory-bound, target() grows with tokens, and speculation switches off: no
over-speculation under load. While off, every PROBE_EVERY-th step drafts anyway, so a request whose
text turns predictable gets speculation back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

PROBE_EVERY = 16  # steps between probes while speculation is judged unprofitable (a probe costs a draft catch-up)
DECAY = 0.95  # weight of the past in the running means: long enough to ride out a hard stretch


@dataclass
class AffineCost:
    """seconds ~ fixed + per_token * tokens, by exponentially weighted least squares."""

    s1: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = 0.95  # costs drift slowly; keep a long memory so several batch shapes inform the slope
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
        if var <= 1e-9:  # one batch shape seen so far: assume the cost does not grow with tokens
            return mean_y
        slope = max(0.0, (self.sxy / self.s1 - mean_x * mean_y) / var)
        return max(0.0, mean_y - slope * mean_x) + slope * tokens


@dataclass
class SpecHistory:
    """One request's recent speculative steps: tokens each yielded, drafts each verified."""

    tokens: float = 0.0
    drafted: float = 0.0
    weight: float = 0.0

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.tokens = DECAY * self.tokens + num_accepted + 1
        self.drafted = DECAY * self.drafted + num_draft
        self.weight = DECAY * self.weight + 1

    @property
    def known(self) -> bool:
        return self.weight > 0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.weight

    @property
    def drafts_per_step(self) -> float:
        return self.drafted / self.weight

    @property
    def acceptance_rate(self) -> float | None:
        return (self.tokens - self.weight) / self.drafted if self.drafted else None


class SpeculationPolicy:
    def __init__(self, k_max: int, uses_draft_model: bool) -> None:
        self.k_max = k_max
        self.target_cost = AffineCost()
        self.draft_cost = AffineCost() if uses_draft_model else None
        self.draft_forwards = float(k_max)  # running mean of draft forwards per drafting step
        self.steps_off = 0
        self.speculating = True

    def observe_target(self, tokens: int, seconds: float) -> None:
        self.target_cost.observe(tokens, seconds)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if self.draft_cost is not None:
            self.draft_cost.observe(tokens, seconds)

    def observe_draft_step(self, num_forwards: int) -> None:
        self.draft_forwards = DECAY * self.draft_forwards + (1 - DECAY) * num_forwards

    def choose_k(self, histories: Seq[SpecHistory]) -> int:
        """Drafts allowed per request this step: k_max where speculation pays, else 0 (or a probe)."""
        if not histories or not self._calibrated() or not all(h.known for h in histories):
            return self.k_max  # measure first
        self.speculating = self._speculative_goodput(histories) > self._plain_goodput(len(histories))
        self.steps_off = 0 if self.speculating else self.steps_off + 1
        if self.speculating or self.steps_off % PROBE_EVERY == 0:
            return self.k_max
        return 0

    def _calibrated(self) -> bool:
        return self.target_cost.known and (self.draft_cost is None or self.draft_cost.known)

    def _plain_goodput(self, batch: int) -> float:
        return batch / self.target_cost(batch)

    def _speculative_goodput(self, histories: Seq[SpecHistory]) -> float:
        batch = len(histories)
        drafted = sum(h.drafts_per_step for h in histories)
        seconds = self.target_cost(batch + drafted)
        if self.draft_cost is not None:
            seconds += self.draft_forwards * self.draft_cost(batch)
        return sum(h.tokens_per_step for h in histories) / seconds
