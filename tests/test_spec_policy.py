"""The adaptive speculation policy: on where measured goodput beats plain decoding, off (with probes) where not."""

from __future__ import annotations

import pytest

from engine.spec_policy import PROBE_EVERY, AffineCost, SpecHistory, SpeculationPolicy

K = 6


def _policy(target_fixed: float, target_per_token: float, draft: float | None, forwards: int = K) -> SpeculationPolicy:
    policy = SpeculationPolicy(K, uses_draft_model=draft is not None)
    for tokens in (1, 4, 8, 16, 32):
        policy.observe_target(tokens, target_fixed + target_per_token * tokens)
        if draft is not None:
            policy.observe_draft(tokens, draft)
    for _ in range(200):
        policy.observe_draft_step(forwards)
    return policy


def _history(tokens_per_step: float, drafts_per_step: int = K) -> SpecHistory:
    history = SpecHistory()
    for _ in range(20):
        history.observe(drafts_per_step, round(tokens_per_step) - 1)
    return history


def test_affine_cost_recovers_line() -> None:
    cost = AffineCost()
    for tokens in (1, 2, 5, 9, 20):
        cost.observe(tokens, 0.2 + 0.01 * tokens)
    assert cost(10) == pytest.approx(0.3, rel=1e-6)
    assert cost(0) == pytest.approx(0.2, rel=1e-6)


def test_history_means() -> None:
    history = _history(5, drafts_per_step=6)
    assert history.tokens_per_step == pytest.approx(5.0)
    assert history.drafts_per_step == pytest.approx(6.0)
    assert history.acceptance_rate == pytest.approx(4 / 6)


def test_measure_first_then_decide() -> None:
    policy = SpeculationPolicy(K, uses_draft_model=True)
    assert policy.choose_k([SpecHistory()]) == K  # nothing measured yet: speculate and measure


def test_high_yield_cheap_draft_speculates() -> None:
    # 6 draft forwards at 20 ms + a 0.21 s verify for 5 tokens beats 0.2 s per token.
    assert _policy(0.2, 0.002, draft=0.02).choose_k([_history(5)]) == K


def test_low_yield_expensive_draft_turns_off_but_probes() -> None:
    policy = _policy(0.2, 0.002, draft=0.08)
    ks = [policy.choose_k([_history(1.5)]) for _ in range(2 * PROBE_EVERY)]
    assert ks.count(0) == 2 * PROBE_EVERY - 2 and ks.count(K) == 2  # off, probing now and then


def test_confident_drafting_changes_the_verdict() -> None:
    # Same yield, but the draft's confidence cutoff stops after 2 forwards on average: now it pays.
    assert _policy(0.2, 0.002, draft=0.08, forwards=6).choose_k([_history(2.5, 2)]) == 0
    assert _policy(0.2, 0.002, draft=0.08, forwards=2).choose_k([_history(2.5, 2)]) == K


def test_large_batch_on_compute_bound_target_stops_speculating() -> None:
    # n-gram drafts cost nothing to make, but every verified token costs 20 ms once compute-bound.
    policy = _policy(0.2, 0.02, draft=None)
    assert policy.choose_k([_history(2.5, 3)]) == K
    assert policy.choose_k([_history(2.5, 3)] * 32) == 0
