"""Per-request k: expected tokens per unit of step cost, decayed acceptance, re-probes, cost."""

from __future__ import annotations

import pytest

from engine.spec_k import (
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    PROBE_K,
    AcceptanceEstimate,
    DraftCost,
    ProposerTrack,
    RequestKPolicy,
    RequestSpecState,
    best_k,
    choose_request_k,
    expected_tokens,
)


def test_expected_tokens_is_one_plus_reach_sums() -> None:
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])


@pytest.mark.parametrize(
    ("rates", "cost", "k"),
    [
        ([1.0] * 6, 0.3, 6),  # everything accepted: as many as allowed
        ([0.1] * 6, 0.3, 0),  # drafts that fail: none
        ([0.9, 0.9, 0.2, 0.2], 0.1, 2),  # stop where the chain breaks
        ([0.7] * 6, 0.0, 6),  # free drafts (n-gram) always pay while anything is accepted
        ([0.7] * 6, 0.35, 2),
    ],
)
def test_best_k(rates: list[float], cost: float, k: int) -> None:
    assert best_k(rates, cost) == k


def test_estimate_follows_recent_behaviour() -> None:
    est = AcceptanceEstimate()
    for _ in range(20):
        est.observe(3, 3)
    assert est.rates(3, base=0.5) == pytest.approx([1.0] * 3, abs=0.3)
    for _ in range(20):
        est.observe(3, 0)
    rates = est.rates(3, base=0.5)
    assert rates[0] < 0.25  # the request's text changed: its own record takes over quickly


def test_unreached_positions_borrow_from_the_one_before() -> None:
    est = AcceptanceEstimate()
    for _ in range(10):
        est.observe(1, 1)
    rates = est.rates(4, base=0.5)
    assert rates[0] > 0.8 and rates[3] > 0.8  # never drafted there, but its neighbour accepts


def test_probes_back_off_while_drafts_keep_losing() -> None:
    track = ProposerTrack()
    for _ in range(30):
        track.acceptance.observe(2, 0)
    ks = [choose_request_k(track, 6, cost=0.35, base=0.1) for _ in range(300)]
    probes = [i for i, k in enumerate(ks) if k]
    assert all(ks[i] == PROBE_K for i in probes)
    assert probes[0] == PROBE_EVERY - 1
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps[0] == 2 * PROBE_EVERY and gaps[-1] == MAX_PROBE_EVERY


def test_cost_is_measured_relative_to_a_plain_step() -> None:
    cost = DraftCost()
    assert cost.relative("draft", 1) == pytest.approx(0.35)  # the prior before any measurement
    for _ in range(5):
        cost.observe_plain(1, 0.100)
        cost.observe_speculative(1, {"draft": 4}, {"draft": 0.120}, verify_seconds=0.120)
    # 30 ms of drafting per token and 5 ms of extra verify per token, against a 100 ms step
    assert cost.relative("draft", 1) == pytest.approx(0.35, rel=0.05)
    for _ in range(40):
        cost.observe_speculative(1, {"draft": 4}, {"draft": 0.040}, verify_seconds=0.120)
    assert cost.relative("draft", 1) == pytest.approx(0.15, rel=0.1)


def test_policy_keeps_separate_records_per_proposer() -> None:
    policy = RequestKPolicy(("ngram", "draft"))
    state = RequestSpecState()
    for _ in range(15):
        policy.observe(state, "ngram", 4, 4)
        policy.observe(state, "draft", 4, 0)
    policy.cost.relative = lambda proposer, batch_size: 0.3  # type: ignore[method-assign]
    ks = policy.choose(state, 6, batch_size=1)
    assert ks["ngram"] == 6 and ks["draft"] == 0


def test_draft_catches_up_only_where_the_rest_of_the_request_pays_for_it() -> None:
    policy = RequestKPolicy(("draft",))
    state = RequestSpecState()
    policy.cost.relative = lambda proposer, batch_size: 0.3  # type: ignore[method-assign]
    policy.cost.catch_up = lambda batch_size: 0.15  # type: ignore[method-assign]
    # Before the draft was seen at work on this traffic, it explores: catch-up is not priced yet.
    assert policy.choose(RequestSpecState(), 3, 1, draft_lag=300, remaining=64)["draft"] > 0
    for _ in range(30):
        policy.observe(state, "draft", 3, 2)
    # 300 prompt tokens to catch up on: 45 plain steps' worth of draft time
    assert policy.choose(state, 3, 1, draft_lag=300, remaining=64)["draft"] == 0
    assert policy.choose(state, 3, 1, draft_lag=300, remaining=1000)["draft"] > 0
    assert policy.choose(state, 3, 1, draft_lag=2, remaining=4)["draft"] > 0  # rides along


def test_catch_up_cost_is_measured() -> None:
    cost = DraftCost()
    cost.observe_plain(1, 0.2)
    cost.observe_catch_up(100, 3.0)  # 30 ms a token against a 200 ms step
    assert cost.catch_up(1) == pytest.approx(0.15)


def test_a_few_early_failures_do_not_talk_everyone_out_of_drafting() -> None:
    policy = RequestKPolicy(("ngram",))
    policy.cost.relative = lambda proposer, batch_size: 0.05  # type: ignore[method-assign]
    first = RequestSpecState()
    policy.observe(first, "ngram", 2, 0)
    assert policy.choose(RequestSpecState(), 3, 1)["ngram"] > 0  # a new request still drafts
