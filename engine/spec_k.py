"""Per-request k: each request drafts as many tokens as pay for themselves, and no more.

Each request keeps a decayed estimate of its own acceptance per draft position and per proposer
(`AcceptanceEstimate`): c_j = P(draft j accepted | drafts 1..j-1 accepted). Drafting k tokens yields
E(k) = 1 + sum_{j<=k} prod_{l<=j} c_l tokens per step; each draft position costs `cost` of a plain
step (`DraftCost`: the proposer's time per drafted token plus the target's extra verify time per
draft token, both measured, relative to a plain step's share per request). The request takes the k
that maximizes E(k) / (1 + k * cost): 0 where its drafts do not pay. A request at k = 0 is re-probed
with a couple of drafts now and then (ever less often while it keeps losing), so a request whose
text turns repetitive starts drafting again.

A new request starts from the proposer's acceptance over all requests (the prior), so the first
steps of a request are not spent learning what the last hundred requests already showed; its own
record outweighs the prior within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_policy import bucket_of

DECAY = 0.8  # per observation: a request's text changes character within tens of tokens
PRIOR_WEIGHT = 2.0  # pseudo-observations of the global acceptance behind a fresh estimate
# The global acceptance itself starts from this rate with this many pseudo-observations, so a few
# failures of the first requests cannot talk every later request out of drafting.
GLOBAL_PRIOR_RATE = 0.6
GLOBAL_PRIOR_WEIGHT = 4.0
# Until the draft model has been verified this often over all requests, its catch-up is not priced:
# the engine must see the draft work on this traffic before it can judge whether it pays.
EXPLORE_DRAFTS = 20.0
PROBE_K = 2  # drafts given to a request at k = 0 when it is re-probed
PROBE_EVERY = 8  # steps at k = 0 before the first re-probe; doubles while probes keep losing
MAX_PROBE_EVERY = 64
# Relative cost of one draft position before anything was measured (a plain step = 1): the draft
# model at about a third of the target, an n-gram lookup nearly free.
PRIOR_COST = {"draft": 0.35, "ngram": 0.05}
# A draft model that has not seen a request's text must first compute it (its prompt, or what it
# missed while the request took n-gram drafts or sat at k = 0). Below this many tokens the catch-up
# rides along in a draft step; above it the draft runs only if the drafts it is expected to win over
# the rest of the request pay for it. Relative cost of one catch-up token before it is measured:
PRIOR_CATCH_UP_COST = 0.15
FREE_CATCH_UP = 8


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
    """One request's record with one proposer: its acceptance, and when to re-probe it at k = 0."""

    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    probe_every: int = PROBE_EVERY
    steps_at_zero: int = 0


@dataclass
class RequestSpecState:
    """What one request remembers about its own drafts, per proposer."""

    tracks: dict[str, ProposerTrack] = field(default_factory=dict)

    def track(
        self, proposer: str, prior: AcceptanceEstimate | None = None, k: int = 0
    ) -> ProposerTrack:
        if proposer not in self.tracks:
            seed = AcceptanceEstimate() if prior is None else AcceptanceEstimate.seeded(prior, k)
            self.tracks[proposer] = ProposerTrack(seed)
        return self.tracks[proposer]


def expected_tokens(rates: list[float]) -> list[float]:
    """E(k) for k = 0..len(rates): 1 + sum over j <= k of prod over l <= j of c_l."""
    out, reach = [1.0], 1.0
    for c in rates:
        reach *= c
        out.append(out[-1] + reach)
    return out


def best_k(rates: list[float], cost: float) -> int:
    """argmax_k E(k) / (1 + k * cost); ties go to the smaller k."""
    gains = expected_tokens(rates)
    scores = [e / (1.0 + k * cost) for k, e in enumerate(gains)]
    return max(range(len(scores)), key=lambda k: (scores[k], -k))


class DraftCost:
    """Measured cost of one draft position relative to one request's share of a plain step."""

    def __init__(self) -> None:
        self.plain_step: dict[
            int, float
        ] = {}  # batch-size bucket -> decayed seconds of a plain step
        self.per_token: dict[str, float] = {}  # proposer -> decayed seconds per drafted token
        self.verify_per_token: float | None = None  # extra target seconds per draft token
        self.catch_up_per_token: float | None = None  # draft seconds per token it catches up on

    def relative(self, proposer: str, batch_size: int) -> float:
        plain = self.plain_step.get(bucket_of(batch_size))
        draft = self.per_token.get(proposer)
        if plain is None or draft is None or self.verify_per_token is None:
            return PRIOR_COST.get(proposer, 0.35)
        return batch_size * (draft + self.verify_per_token) / plain

    def catch_up(self, batch_size: int) -> float:
        """Seconds to catch the draft up on one token, relative to a plain step."""
        plain = self.plain_step.get(bucket_of(batch_size))
        if plain is None or self.catch_up_per_token is None:
            return PRIOR_CATCH_UP_COST
        return self.catch_up_per_token / plain

    def observe_catch_up(self, num_tokens: int, seconds: float) -> None:
        per_token = seconds / max(1, num_tokens)
        self.catch_up_per_token = _ewma(self.catch_up_per_token, per_token, 0.3)

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        bucket = bucket_of(batch_size)
        self.plain_step[bucket] = _ewma(self.plain_step.get(bucket), seconds)

    def observe_speculative(
        self,
        batch_size: int,
        drafted: dict[str, int],  # proposer -> draft tokens it proposed this step
        propose_seconds: dict[str, float],  # proposer -> seconds it took
        verify_seconds: float,  # the target's forward (and verification) this step
    ) -> None:
        for name, n in drafted.items():
            if n > 0:
                per_token = propose_seconds.get(name, 0.0) / n
                self.per_token[name] = _ewma(self.per_token.get(name), per_token)
        total = sum(drafted.values())
        plain = self.plain_step.get(bucket_of(batch_size))
        if total > 0 and plain is not None:
            extra = max(0.0, verify_seconds - plain) / total
            self.verify_per_token = _ewma(self.verify_per_token, extra)


def _ewma(prev: float | None, value: float, weight: float = 0.1) -> float:
    """Exponentially weighted mean: the first value as is, then `weight` for each new one."""
    return value if prev is None else (1.0 - weight) * prev + weight * value


def choose_request_k(track: ProposerTrack, k_max: int, cost: float, base: float) -> int:
    """This request's k with one proposer for this step, re-probing now and then while at 0."""
    if k_max <= 0:
        return 0
    k = best_k(track.acceptance.rates(k_max, base), cost)
    if k > 0:
        track.steps_at_zero, track.probe_every = 0, PROBE_EVERY
        return k
    track.steps_at_zero += 1
    if track.steps_at_zero >= track.probe_every:
        track.steps_at_zero = 0
        track.probe_every = min(2 * track.probe_every, MAX_PROBE_EVERY)
        return min(PROBE_K, k_max)
    return 0


class RequestKPolicy:
    """Per-request k for every proposer, from the request's own acceptance and the measured cost."""

    def __init__(self, proposers: tuple[str, ...]) -> None:
        self.proposers = proposers
        self.cost = DraftCost()
        self.priors = {name: AcceptanceEstimate() for name in proposers}

    def choose(
        self,
        state: RequestSpecState,
        k_max: int,
        batch_size: int,
        draft_lag: int = 0,  # tokens the draft model has not computed yet
        remaining: int = 1 << 30,  # output tokens the request may still produce
    ) -> dict[str, int]:
        """proposer -> k for this request this step."""
        ks = {}
        for name in self.proposers:
            cost = self.cost.relative(name, batch_size)
            track = state.track(name)
            prior = self.priors[name]
            k = choose_request_k(track, k_max, cost, prior.pooled_rate())
            explored = prior.evidence >= EXPLORE_DRAFTS
            if name == "draft" and k > 0 and draft_lag > FREE_CATCH_UP and explored:
                rates = track.acceptance.rates(k, prior.pooled_rate())
                k = k if self._catch_up_pays(rates, cost, draft_lag, remaining, batch_size) else 0
            ks[name] = k
        return ks

    def _catch_up_pays(
        self, rates: list[float], cost: float, lag: int, remaining: int, batch_size: int
    ) -> bool:
        """Do the plain steps the drafts save over the rest of the request outweigh catching up?"""
        k = len(rates)
        steps_per_token = (1.0 + k * cost) / expected_tokens(rates)[-1]  # < 1 where drafts pay
        saved = remaining * (1.0 - steps_per_token)
        return saved > lag * self.cost.catch_up(batch_size)

    def observe(self, state: RequestSpecState, proposer: str, drafted: int, accepted: int) -> None:
        if drafted <= 0 or proposer not in self.priors:
            return
        state.track(proposer).acceptance.observe(drafted, accepted)
        self.priors[proposer].observe(drafted, accepted, decay=0.99)
