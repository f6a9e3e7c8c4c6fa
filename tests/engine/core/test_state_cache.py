"""StateSnapshots on its own: the deepest snapshotted prefix, rows reused, least recently used
evicted first."""

from __future__ import annotations

from engine.core.state_cache import StateSnapshots


def test_deepest_snapshotted_prefix() -> None:
    snapshots = StateSnapshots(4)
    assert snapshots.deepest([11, 12, 13]) == (0, None)
    row = snapshots.reserve(12)
    assert snapshots.deepest([11, 12, 13]) == (2, row)
    deeper = snapshots.reserve(13)
    assert deeper != row
    assert snapshots.deepest([11, 12, 13]) == (3, deeper)
    assert snapshots.deepest([11, 12]) == (2, row)
    assert snapshots.deepest([21, 22]) == (0, None)  # another prefix altogether


def test_a_key_keeps_its_row() -> None:
    snapshots = StateSnapshots(2)
    row = snapshots.reserve(5)
    assert snapshots.reserve(5) == row
    assert len(snapshots) == 1


def test_least_recently_used_is_evicted() -> None:
    snapshots = StateSnapshots(2)
    a, b = snapshots.reserve(1), snapshots.reserve(2)
    assert {a, b} == {0, 1}
    assert snapshots.deepest([1]) == (1, a)  # a used: b is now the least recently used
    c = snapshots.reserve(3)
    assert c == b
    assert snapshots.deepest([2]) == (0, None)
    assert snapshots.deepest([1]) == (1, a)
    assert snapshots.deepest([3]) == (1, c)
    assert len(snapshots) == 2
