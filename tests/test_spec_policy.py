"""The adaptive speculation policy: k follows measured costs and acceptance, never stuck at zero."""

from __future__ import annotations

import pytest

from engine.spec_policy import PROBE_EVERY, AcceptanceEstimate, AffineCost, SpeculationPolicy, expected_tokens


def _policy(target_fixed: float, target_per_token: float, draft: float | None, k_max: int = 6) -> SpeculationPolicy:
    policy = SpeculationPolicy(k_max, uses_draft_model=draft is not None)
    for tokens in (1, 4, 8, 16, 32):
        policy.observe_target(tokens, target_fixed + target_per_token * tokens)
        if draft is not None:
            policy.observe_draft(tokens, draft)
    return policy


def test_affine_cost_recovers_line() -> None:
    cost = AffineCost()
    for tokens in (1, 2, 5, 9, 20):
        cost.observe(tokens, 0.2 + 0.01 * tokens)
    assert cost(10) == pytest.approx(0.3, rel=1e-6)
    assert cost(0) == pytest.approx(0.2, rel=1e-6)


def test_expected_tokens() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)


def test_high_acceptance_cheap_draft_speculates_fully() -> None:
    policy = _policy(0.2, 0.002, draft=0.02)
    assert policy.choose_k([0.95], other_tokens=0) == 6


def test_low_acceptance_expensive_draft_turns_speculation_off_but_probes() -> None:
    policy = _policy(0.2, 0.002, draft=0.15)
    ks = [policy.choose_k([0.1], other_tokens=0) for _ in range(2 * PROBE_EVERY)]
    assert ks.count(0) == 2 * PROBE_EVERY - 2 and ks.count(1) == 2  # off, with a k = 1 probe now and then


def test_large_batch_on_compute_bound_target_stops_speculating() -> None:
    # Verify cost grows with every token: at 32 requests, extra draft tokens cost more than they yield.
    policy = _policy(0.2, 0.02, draft=None)
    assert policy.choose_k([0.6], other_tokens=0) > 0
    assert policy.choose_k([0.6] * 32, other_tokens=0) == 0


def test_uncalibrated_policy_uses_k_max() -> None:
    assert SpeculationPolicy(4, uses_draft_model=True).choose_k([0.5], 0) == 4


def test_acceptance_estimate_tracks_recent_runs() -> None:
    est = AcceptanceEstimate()
    assert est.rate == 0.5
    for _ in range(30):
        est.observe(4, 4)
    assert est.rate > 0.95
    for _ in range(30):
        est.observe(4, 0)
    assert est.rate < 0.25
