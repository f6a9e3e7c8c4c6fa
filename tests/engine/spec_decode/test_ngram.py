"""The n-gram index against the plain scan it replaces, on texts that grow as a request's does."""

from __future__ import annotations

import random

import pytest

from bench.ngram_lookup import scan
from engine.spec_decode.proposers.ngram import NgramIndex


@pytest.mark.parametrize(("n_min", "n_max", "vocab"), [(1, 3, 5), (2, 4, 4), (2, 4, 50), (3, 3, 3)])
def test_index_proposes_what_the_scan_does_as_the_text_grows(
    n_min: int, n_max: int, vocab: int
) -> None:
    rng = random.Random(n_min * 100 + vocab)
    proposed = 0
    for _ in range(20):
        text = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        index = NgramIndex(n_min, n_max)
        while len(text) < 120:
            k = rng.randint(1, 6)
            expected = scan(text, k, n_min, n_max)
            assert index.lookup(text, k) == expected, (text, k)
            proposed += bool(expected)
            text.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))  # accepted run
    assert proposed > 20  # the small vocabularies do repeat


def test_index_starts_over_on_a_shorter_text() -> None:
    index = NgramIndex(1, 2)
    assert index.lookup([1, 2, 3, 1, 2], 2) == [3, 1]
    assert index.lookup([7, 8, 7], 2) == [8, 7]
