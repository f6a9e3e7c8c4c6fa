"""What a request remembers about its own drafts: decayed acceptance per draft position and per
proposer, and when a proposer that stopped paying is probed again. Pure state, no policy: the
planner (`engine/spec_decode/planner.py`) reads it to decide each step's drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8  # per observation: a request's text changes character within tens of tokens
PRIOR_WEIGHT = 2.0  # pseudo-observations of the global acceptance behind a fresh estimate
# The global acceptance itself starts from this rate with this many pseudo-observations, so a few
# failures of the first requests cannot talk every later request out of drafting.
GLOBAL_PRIOR_RATE = 0.6
GLOBAL_PRIOR_WEIGHT = 4.0
PROBE_EVERY = 8  # steps without drafts before the first re-probe; doubles while probes keep losing
MAX_PROBE_EVERY = 64


@dataclass
class AcceptanceEstimate:
    """Decayed counts per draft position: reached (drafted with every earlier draft accepted) and
    accepted. Every observation decays all positions, so what a request did long ago fades."""

    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int, decay: float = DECAY) -> None:
        while len(self.reached) < num_drafted:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for j in range(len(self.reached)):
            looked = j < num_drafted and j <= num_accepted  # the verify looked at position j
            self.reached[j] = decay * self.reached[j] + float(looked)
            self.accepted[j] = decay * self.accepted[j] + float(looked and j < num_accepted)

    def rates(self, k: int, base: float) -> list[float]:
        """c_1..c_k. Each position is shrunk toward the rate of the one before it (the first toward
        `base`, the acceptance over all requests) with PRIOR_WEIGHT pseudo-observations, so a
        position this request rarely reaches borrows from its neighbour."""
        out = []
        for j in range(k):
            n, a = (self.reached[j], self.accepted[j]) if j < len(self.reached) else (0.0, 0.0)
            base = (a + PRIOR_WEIGHT * base) / (n + PRIOR_WEIGHT)
            out.append(base)
        return out

    def pooled_rate(self) -> float:
        """The first position's rate over all requests, behind GLOBAL_PRIOR_WEIGHT pseudo-counts."""
        n, a = (self.reached[0], self.accepted[0]) if self.reached else (0.0, 0.0)
        return (a + GLOBAL_PRIOR_WEIGHT * GLOBAL_PRIOR_RATE) / (n + GLOBAL_PRIOR_WEIGHT)

    @property
    def evidence(self) -> float:
        return self.reached[0] if self.reached else 0.0


@dataclass
class ProposerTrack:
    """One request's record with one proposer: its acceptance, and when to re-probe it."""

    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    probe_every: int = PROBE_EVERY
    steps_without: int = 0  # steps since this proposer last drafted for the request

    @property
    def probe_due(self) -> bool:
        return self.steps_without >= self.probe_every

    def planned(self, drafts: int, probe: bool) -> None:
        """The plan gave the request this many drafts from this proposer."""
        if drafts == 0:
            self.steps_without += 1
            return
        self.steps_without = 0
        self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY) if probe else PROBE_EVERY


@dataclass
class RequestSpecState:
    """What one request remembers about its own drafts, per proposer."""

    tracks: dict[str, ProposerTrack] = field(default_factory=dict)

    def track(self, proposer: str) -> ProposerTrack:
        return self.tracks.setdefault(proposer, ProposerTrack())


def reach(rates: list[float]) -> list[float]:
    """g_j = c_1 * ... * c_j: the expected tokens draft j adds (it counts only if all before it do)."""
    out, p = [], 1.0
    for c in rates:
        p *= c
        out.append(p)
    return out
