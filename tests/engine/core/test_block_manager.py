"""BlockManager on its own: free list, reference counts, the prefix cache and draft K/V flags."""

from __future__ import annotations

from engine.core.block_manager import BlockManager

BS = 4


def _assert_consistent(bm: BlockManager, live: list[list[int]]) -> None:
    """Every block is either free or referenced by exactly the live tables that hold it."""
    counts = [0] * bm.num_blocks
    for table in live:
        for block in table:
            counts[block] += 1
    assert bm._ref_counts == counts
    assert set(bm._free) == {b for b in range(bm.num_blocks) if counts[b] == 0}


def _filled(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    table: list[int] = []
    hashes: list[int] = []
    assert bm.grow(table, len(tokens))
    bm.cache_full_blocks(tokens, table, hashes, len(tokens))
    return table, hashes


def test_grow_release_and_out_of_blocks() -> None:
    bm = BlockManager(4, BS)
    a: list[int] = []
    assert bm.grow(a, 9) and len(a) == 3
    b: list[int] = []
    assert not bm.grow(b, 8) and b == []  # two needed, one free: no partial allocation
    assert bm.grow(b, 4)
    _assert_consistent(bm, [a, b])
    assert bm.usage == 1.0
    bm.release(a)
    assert a == [] and bm.num_free_blocks == 3
    _assert_consistent(bm, [b])


def test_prefix_is_shared_by_reference_and_survives_release() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    table, hashes = _filled(bm, tokens)
    assert len(hashes) == 2  # two full blocks registered, the partial third is not
    assert bm.match_prefix(tokens) == table[:2]
    assert bm.match_prefix(tokens[:8]) == table[:1]  # the last token is always left to compute
    other = tokens[:4] + [99] * 6
    assert bm.match_prefix(other) == table[:1]  # chained keys: a different second block misses
    cached = table[:2]
    shared = bm.match_prefix(tokens)
    bm.acquire(shared)
    _assert_consistent(bm, [table, shared])
    bm.release(table)
    assert bm.match_prefix(tokens) == cached  # still referenced by the sharer
    bm.release(shared)
    assert bm.match_prefix(tokens) == cached  # freed, but its key is kept until reuse
    _assert_consistent(bm, [])


def test_reused_blocks_lose_their_key_and_draft_flag() -> None:
    bm = BlockManager(3, BS)
    tokens = list(range(9))
    table, hashes = _filled(bm, tokens)
    assert bm.mark_draft_computed(table, 0, 8) == 2
    assert bm.num_draft_computed(bm.match_prefix(tokens)) == 2
    bm.release(table)
    grabbed: list[int] = []
    assert bm.grow(grabbed, 12)  # takes every freed block: their cached contents are gone
    assert bm.match_prefix(tokens) == [] and bm._draft_computed == set()


def test_hashing_resumes_where_it_stopped() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(20))
    table: list[int] = []
    hashes: list[int] = []
    assert bm.grow(table, 20)
    bm.cache_full_blocks(tokens, table, hashes, 6)
    assert len(hashes) == 1
    bm.cache_full_blocks(tokens, table, hashes, 17)
    assert hashes == bm.chain_hashes(tokens, 4)
    assert bm.match_prefix(tokens) == table[:4]
    bm.cache_full_blocks(tokens[:10], table, hashes, 30)  # never past the known tokens
    assert len(hashes) == 4


def test_draft_flags_only_on_leading_computed_blocks() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(17))
    table, _ = _filled(bm, tokens)
    assert bm.num_draft_computed(bm.match_prefix(tokens)) == 0  # a plain request: no draft K/V
    assert bm.mark_draft_computed(table, 0, 9) == 2
    assert bm.num_draft_computed(bm.match_prefix(tokens)) == 2


def test_lookup_stats_are_deltas() -> None:
    bm = BlockManager(4, BS)
    bm.record_lookup(10, 4)
    assert bm.take_lookup_stats() == (10, 4)
    bm.record_lookup(3, 0)
    assert bm.take_lookup_stats() == (3, 0)
    assert bm.take_lookup_stats() == (0, 0)
