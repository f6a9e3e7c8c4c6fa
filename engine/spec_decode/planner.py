"""How many tokens each request drafts this step, and from which proposer: the plan that pays best.

Each request keeps a decayed estimate of its own acceptance per draft position and per proposer
(`AcceptanceEstimate`): c_j = P(draft j accepted | drafts 1..j-1 accepted), so draft j is worth
g_j = c_1 * ... * c_j expected tokens. What a draft costs is not a constant: it is the draft
model's forwards (none for an n-gram lookup or grammar-forced tokens) plus what one more row adds
to the target's forward, and that depends on the rows already in the step (`engine/spec_decode/step_cost.py`
measures both curves: on a tiled CPU kernel the rows that fill a tile are free, the next one costs
a tile). So the choice is made for the whole step at once (`plan_step`): among the allocations
that take each request's best positions first, the one with the most expected tokens per second
of step time, where plain decoding (no drafts) is one of the candidates. A request that was not
given drafts for a while is re-probed at the acceptance over all requests (the prior), ever less
often while its probes keep failing, so a request whose text turns repetitive drafts again.

A draft model that has not seen a request's text (its prompt, or what it missed while the request
took n-gram drafts or no drafts) must compute it first. Up to FREE_CATCH_UP tokens ride along in
its first draft forward; beyond that the draft model runs for the request only where the steps its
drafts are expected to save over the rest of the request outweigh the catch-up. How much of the
request is left is an estimate (`OutputLengths`), not max_tokens: a summary that ends after a few
tokens must not pay for a catch-up on its whole prompt.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sample.structured import FORCED_SOURCE
from engine.spec_decode.acceptance import (
    AcceptanceEstimate,
    RequestSpecState,
    reach,
)
from engine.spec_decode.step_cost import StepCosts

if TYPE_CHECKING:
    from engine.sequence import ScheduledSeq, Sequence

log = logging.getLogger("specserve.planner")

# Until a proposer has been verified this often over all requests, it is planned as if its drafts
# were accepted at OPTIMISTIC_RATE (its catch-ups priced at that rate too): the engine must
# see a proposer at work on this traffic before it can judge whether it pays, and a plan made from
# a pessimistic guess would never try it.
EXPLORE_DRAFTS = 8
OPTIMISTIC_RATE = 0.9
PROBE_K = 2  # drafts a request may get when it is re-probed
FREE_CATCH_UP = 8  # tokens the draft model computes in its first forward without asking
FED_BACK = 2  # rows a drafting request usually adds to the draft's first forward (last + bonus)
# proposers that draft from the target's kept hidden states
FEATURE_HEADS = ("eagle3", "mtp", "gemma4-assistant")
LENGTH_WINDOW = 8  # finished answers whose lower quartile is the typical length
# A request is expected to run at most this many times the tokens it has produced so far: the
# window tells how long answers run here, only the request's own tokens tell about this one.
EVIDENCE_MULTIPLE = 4
# Drafts are planned only where they are expected to beat plain decoding by this much: the cost model
# leaves out small per-draft costs (verification, bookkeeping), which all lean toward drafting.
MIN_GAIN = 1.03
# In a step that computes prompt tokens, drafts may slow the step by at most this factor, so time
# to first token stays the plain path's.
FIRST_TOKEN_SLOWDOWN = 1.05


@dataclass(frozen=True)
class DraftOption:
    """One request's way to draft this step."""

    index: int  # the request's place in the step's batch
    proposer: str
    gains: list[float]  # gains[j]: expected tokens added by draft j + 1
    draft_rows: int = 0  # draft model: rows of its first forward for this request; 0 = no forward
    probe: bool = False  # gains are the prior's: the request is being re-probed
    level_rows: int = 1  # rows of each later draft forward: a draft tree's width, a chain's 1


def plan_step(
    options: list[DraftOption],
    base_rows: int,
    base_tokens: float,
    costs: StepCosts,
    max_slowdown: float | None = None,
) -> dict[int, int]:
    """request index -> drafts, maximizing expected tokens per second of this step.

    base_rows / base_tokens: the target rows and emitted tokens the step has without any option
    (prompt chunks, one row per decoding request, grammar-forced drafts). Candidate plans take
    draft positions in order of gain (a request's positions in order, since gains only fall), with
    the draft model's depth capped at each possible value so cheap n-gram positions are weighed
    without the draft's forwards; every prefix is scored with the measured cost curves, and one
    wins only by MIN_GAIN over no drafts at all. max_slowdown: no plan may make the step slower
    than this factor of the step without drafts (a step that produces first tokens)."""
    best: dict[int, int] = {}
    plain = _seconds(costs, base_rows, 0, [])
    best_score = MIN_GAIN * base_tokens / plain
    limit = plain * max_slowdown if max_slowdown is not None else float("inf")
    max_depth = max((len(o.gains) for o in options if o.draft_rows), default=0)
    for cap in range(max_depth + 1):
        positions = sorted(
            (
                (g, j, o)
                for o in options
                for j, g in enumerate(o.gains if not o.draft_rows else o.gains[:cap])
            ),
            key=lambda p: (-p[0], p[1]),
        )
        depths: dict[int, int] = {}
        # the draft model's forwards: rows of the first (catch-up included), then of each later one
        first_rows, deeper = 0, [0] * max_depth
        tokens, rows = base_tokens, base_rows
        for gain, j, option in positions:
            depths[option.index] = j + 1
            tokens, rows = tokens + gain, rows + 1
            if option.draft_rows:
                if j == 0:
                    first_rows += option.draft_rows
                else:
                    deeper[j] += option.level_rows
            seconds = _seconds(costs, rows, first_rows, deeper)
            score = tokens / seconds
            if score > best_score and seconds <= limit:
                best_score, best = score, dict(depths)
    return best


def _seconds(
    costs: StepCosts, target_rows: int, draft_first: int, draft_deeper: list[int]
) -> float:
    forwards = [m for m in (draft_first, *draft_deeper) if m]
    draft = sum(costs.draft.seconds(m) + costs.draft_overhead for m in forwards)
    return costs.target.seconds(target_rows) + draft + costs.overhead


@dataclass
class OutputLengths:
    """How long answers run here: the lower quartile of the last LENGTH_WINDOW finished answers,
    and from it how many more tokens a running request is expected to produce.

    A low quantile, not a mean: a wrong "long" costs a whole prompt catch-up (a second for a
    summary's prompt that ends two tokens later), a wrong "short" only delays drafting until the
    request has produced enough to pay for it. Two short answers among eight are enough to stop
    betting on length; the mean needed about six (spec_grid, summarization after code and chat:
    0.27x and 0.60x of plain)."""

    recent: deque[int] = field(default_factory=lambda: deque(maxlen=LENGTH_WINDOW))

    @property
    def typical(self) -> int | None:
        if not self.recent:
            return None
        return sorted(self.recent)[(len(self.recent) - 1) // 4]

    def observe(self, length: int, capped: bool = False) -> None:
        """One finished answer. A `capped` one (stopped by its max_tokens) only says the answer
        would have run at least that long: it counts as no shorter than the typical one, so a
        priming request with max_tokens = 1 does not make every answer look short."""
        typical = self.typical
        if capped:
            if typical is None:
                return
            length = max(length, typical)
        self.recent.append(length)

    def remaining(self, produced: int, max_tokens: int) -> float:
        """Tokens left: what the typical answer has left, but at least as many as the request has
        produced (one that outlives the typical answer is likely a long one), within max_tokens;
        and never more than EVIDENCE_MULTIPLE times what it has produced. That cap makes a catch-up
        on a long prompt wait for a few tokens of evidence: the window's answers may be another
        kind of request's (summaries after code), and the request ending two tokens later would
        leave the catch-up a pure loss (spec_grid, first summary after code and chat: 0.28x of
        plain). A long answer pays for the wait with a step or two of plain decoding."""
        left = float(max_tokens - produced)
        typical = self.typical
        guess = left if typical is None else max(typical - produced, float(produced))
        return min(left, guess, float(EVIDENCE_MULTIPLE * max(produced, 1)))


class SpecPlanner:
    """Turns each scheduled request's draft ceilings into this step's drafts (`plan`), and keeps the
    acceptance records the plans are made from (`observe`)."""

    def __init__(self, proposers: tuple[str, ...], costs: StepCosts, tree_width: int = 1) -> None:
        self.proposers = proposers
        self.costs = costs
        # the draft model's or head's trees: each level after the first runs this many rows a request
        self.tree_width = tree_width
        self.priors = {name: AcceptanceEstimate() for name in proposers}
        self.verified = dict.fromkeys(proposers, 0)  # draft steps verified so far, per proposer
        self.lengths = OutputLengths()
        self.states: dict[str, RequestSpecState] = {}  # request id -> its own drafts' record

    def state_of(self, seq: Sequence) -> RequestSpecState:
        """A running request's record (kept here, not on the request: policy state is the
        planner's), dropped when the request finishes."""
        state = self.states.get(seq.request_id)
        if state is None:
            state = self.states[seq.request_id] = RequestSpecState()
        return state

    def plan(self, batch: list[ScheduledSeq], ngram_drafts: Callable[[ScheduledSeq], int]) -> None:
        """Cut each adaptive request's spec_k ceilings down to the step's best plan.
        ngram_drafts(item): how many drafts an n-gram lookup finds for it now."""
        base_rows = sum(item.num_new_tokens for item in batch)
        # A long draft catch-up in a step that also computes prompt tokens would hold back those
        # requests' first tokens: it waits for a step of decodes only.
        prefilling = any(item.num_prompt_tokens > 0 for item in batch)
        base_tokens = 0.0
        planned: list[int] = []  # batch indices of the requests this plan decides
        for i, item in enumerate(batch):
            if not item.reaches_end:
                continue
            base_tokens += 1
            forced = item.k_for(FORCED_SOURCE)
            if forced or not item.num_spec_tokens:
                base_rows += item.num_spec_tokens
                base_tokens += forced
            else:
                planned.append(i)
        options = [
            option
            for i in planned
            if (
                option := self._option(i, batch[i], ngram_drafts, base_rows, len(batch), prefilling)
            )
        ]
        # A step that gives requests their first token takes only drafts that barely slow it down.
        slowdown = FIRST_TOKEN_SLOWDOWN if prefilling else None
        depths = plan_step(options, base_rows, base_tokens, self.costs, slowdown)
        chosen = {o.index: o for o in options}
        for i in planned:
            item, option, drafts = batch[i], chosen.get(i), depths.get(i, 0)
            for name in item.spec_k:
                picked = option is not None and name == option.proposer
                item.spec_k[name] = drafts if picked else 0
                self.state_of(item.seq).track(name).planned(
                    item.spec_k[name],
                    picked and option.probe,  # type: ignore[union-attr]
                )
            item.num_spec_tokens = drafts

    def observe(self, state: RequestSpecState, proposer: str, drafted: int, accepted: int) -> None:
        if drafted <= 0 or proposer not in self.priors:
            return
        state.track(proposer).acceptance.observe(drafted, accepted)
        self.priors[proposer].observe(drafted, accepted, decay=0.99)
        self.verified[proposer] += 1

    def finished(self, seq: Sequence) -> None:
        """A request ended: its record goes, its answer's length joins the window unless it was
        aborted (a length-limited one counts as capped)."""
        self.states.pop(seq.request_id, None)
        if seq.finish_reason != "abort":
            self.lengths.observe(seq.num_output_tokens, capped=seq.finish_reason == "length")

    def _option(
        self,
        index: int,
        item: ScheduledSeq,
        ngram_drafts: Callable[[ScheduledSeq], int],
        base_rows: int,
        batch_size: int,
        prefilling: bool,
    ) -> DraftOption | None:
        """The request's n-gram match or the draft model, whichever gives the step more tokens
        per second; the draft only where its catch-up (if any) pays."""
        state, seq = self.state_of(item.seq), item.seq
        matched = ngram_drafts(item) if item.k_for("ngram") else 0
        ngram = self._gains(state, "ngram", matched) if matched else None
        head = next((h for h in FEATURE_HEADS if item.k_for(h)), None)
        if head is not None:
            return self._head_option(index, item, state, head, ngram, base_rows, batch_size)
        draft = self._gains(state, "draft", item.k_for("draft")) if item.k_for("draft") else None
        lag = seq.num_tokens - seq.num_draft_computed_tokens
        remaining = self.lengths.remaining(seq.num_output_tokens, seq.params.max_tokens)
        if draft is not None and lag > FREE_CATCH_UP:
            if prefilling or not self._catch_up_pays(
                draft[0], lag, remaining, base_rows, batch_size
            ):
                draft = None
            else:
                log.debug(
                    "%s: draft catch-up of %d tokens may pay (%.0f tokens expected left, %d rows)",
                    seq.request_id,
                    lag,
                    remaining,
                    base_rows,
                )
        if ngram and (
            draft is None or self._ngram_pays_more(ngram[0], draft[0], base_rows, batch_size)
        ):
            return DraftOption(index, "ngram", *ngram)
        if draft is None:
            return None
        gains, probe = draft
        rows = lag if lag <= FREE_CATCH_UP else FED_BACK  # a long catch-up is priced above instead
        return DraftOption(
            index, "draft", gains, max(1, rows), probe=probe, level_rows=self.tree_width
        )

    def _head_option(
        self,
        index: int,
        item: ScheduledSeq,
        state: RequestSpecState,
        head: str,
        ngram: tuple[list[float], bool] | None,  # the request's n-gram match's gains, if any
        base_rows: int,
        batch_size: int,
    ) -> DraftOption | None:
        """An EAGLE-3 or MTP head, priced on the draft's curve; its catch-up (what the target
        accepted since) rides in its first forward. It drafts only in a step that computes just
        the last token: the features of the others do not exist yet. An n-gram match
        (hybrid-eagle3) is taken instead where it gives the step more tokens per second."""
        own = None
        if item.num_new_tokens == 1:
            own = self._gains(state, head, item.k_for(head))
        if ngram and (
            own is None or self._ngram_pays_more(ngram[0], own[0], base_rows, batch_size)
        ):
            return DraftOption(index, "ngram", *ngram)
        if own is None:
            return None
        return DraftOption(index, head, own[0], FED_BACK, probe=own[1], level_rows=self.tree_width)

    def _ngram_pays_more(
        self, ngram: list[float], draft: list[float], base_rows: int, batch_size: int
    ) -> bool:
        """Expected tokens per second of the step with this request's n-gram drafts (free to
        propose) against its draft model's (paid in draft forwards)."""
        target = self.costs.target
        ngram_rate = (batch_size + sum(ngram)) / target.seconds(base_rows + len(ngram))
        draft_step = target.seconds(base_rows + len(draft)) + self._draft_seconds(len(draft))
        return ngram_rate >= (batch_size + sum(draft)) / draft_step

    def _draft_seconds(self, k: int) -> float:
        """The draft model's forwards for k drafts of one request: the first carries the tokens fed
        back from the last step, each later one a tree level's width."""
        draft, width = self.costs.draft, self.tree_width
        return (
            draft.seconds(FED_BACK) + (k - 1) * draft.seconds(width) + k * self.costs.draft_overhead
        )

    def _gains(self, state: RequestSpecState, name: str, k: int) -> tuple[list[float], bool]:
        """This request's gains for k drafts from one proposer, or the prior's when a probe is due."""
        track = state.track(name)
        pooled = self.priors[name].pooled_rate()
        if self.verified[name] < EXPLORE_DRAFTS:
            pooled = max(pooled, OPTIMISTIC_RATE)
        if track.probe_due:
            return reach(AcceptanceEstimate().rates(min(k, PROBE_K), pooled)), True
        return reach(track.acceptance.rates(k, pooled)), False

    def _catch_up_pays(
        self, gains: list[float], lag: int, remaining: float, batch_rows: int, batch_size: int
    ) -> bool:
        """Does the batch time the drafts should save over the rest of the request outweigh the
        draft model computing `lag` tokens first, a wait the whole step shares?

        Each drafting step gives this request sum(gains) more tokens, worth that many of the
        batch's per-token share of a plain step, and makes the step dearer for everyone by the
        extra verify rows and draft forwards. (While the draft is being explored the gains are
        the optimistic ones: a catch-up that would not pay even then is never run.)"""
        if lag <= FREE_CATCH_UP:
            return True
        target, draft, k = self.costs.target, self.costs.draft, len(gains)
        plain_step = target.seconds(batch_rows)
        extra = target.seconds(batch_rows + k) - plain_step + self._draft_seconds(k)
        saved_per_step = sum(gains) * plain_step / batch_size - extra
        return remaining / (1.0 + sum(gains)) * saved_per_step > draft.seconds(lag)
