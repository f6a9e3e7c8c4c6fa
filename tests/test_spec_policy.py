"""The adaptive speculation policy: whichever mode measures faster runs, the other is retried."""

from __future__ import annotations

from engine.spec_policy import EXPLORE_EVERY, MAX_EXPLORE_EVERY, SpeculationPolicy, bucket_of

K = 6


def _run(
    policy: SpeculationPolicy, batch: int, steps: int, spec_rate: float, plain_rate: float
) -> list[int]:
    """Drive the policy with steps whose goodput is spec_rate or plain_rate tokens/s."""
    ks = []
    for _ in range(steps):
        k = policy.choose_k(batch)
        ks.append(k)
        rate = spec_rate if k else plain_rate
        policy.observe(batch, k > 0, tokens=batch * 2, seconds=batch * 2 / rate)
    return ks


def test_buckets_group_similar_batch_sizes() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_measures_both_modes_first() -> None:
    policy = SpeculationPolicy(K)
    assert _run(policy, 1, 2, spec_rate=10, plain_rate=5) == [K, 0]


def _tries(ks: list[int], losing: int) -> list[int]:
    """Indices (after the two measuring steps) where the losing mode was tried."""
    return [i for i, k in enumerate(ks[2:]) if k == losing]


def test_speculates_where_it_pays_and_still_checks_plain_less_and_less_often() -> None:
    ks = _run(SpeculationPolicy(K), 1, 8 * MAX_EXPLORE_EVERY, spec_rate=8, plain_rate=5)
    tries = _tries(ks, 0)
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert tries[0] == EXPLORE_EVERY - 1
    assert gaps[:2] == [2 * EXPLORE_EVERY, 4 * EXPLORE_EVERY] and set(gaps[2:]) == {
        MAX_EXPLORE_EVERY
    }


def test_turns_off_where_it_loses_and_probes() -> None:
    ks = _run(SpeculationPolicy(K), 16, 8 * MAX_EXPLORE_EVERY, spec_rate=30, plain_rate=45)
    assert 5 <= len(_tries(ks, K)) <= 10 and ks.count(0) > 0.97 * len(ks)


def test_verdict_follows_a_change_in_the_text() -> None:
    policy = SpeculationPolicy(K)
    _run(policy, 1, 3 * EXPLORE_EVERY, spec_rate=8, plain_rate=5)
    assert policy.verdicts() == {0: True}
    _run(policy, 1, 6 * EXPLORE_EVERY, spec_rate=3, plain_rate=5)  # prose: drafts stop paying
    assert policy.verdicts() == {0: False}


def test_each_load_level_has_its_own_verdict() -> None:
    policy = SpeculationPolicy(K)
    _run(policy, 1, 2 * EXPLORE_EVERY, spec_rate=8, plain_rate=5)
    _run(policy, 16, 2 * EXPLORE_EVERY, spec_rate=30, plain_rate=45)
    assert policy.verdicts() == {0: True, 4: False}
