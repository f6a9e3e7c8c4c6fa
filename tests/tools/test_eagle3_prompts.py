"""The chat prompt set for a head's training answers: distinct, seeded, every kind early."""

from __future__ import annotations

import pytest

from tools.eagle3_prompts import TEMPLATES, chat_prompts


def test_prompts_are_distinct_seeded_and_cycle_through_the_kinds() -> None:
    prompts = chat_prompts(2 * len(TEMPLATES), seed=0)
    texts = [p.messages[0][1] for p in prompts]
    assert len(set(texts)) == len(texts)
    assert chat_prompts(2 * len(TEMPLATES), seed=0) == prompts
    assert chat_prompts(2 * len(TEMPLATES), seed=1) != prompts
    stems = [t.split("{s}")[0] for t in TEMPLATES]
    first = texts[: len(TEMPLATES)]  # one of each template, in order
    assert all(text.startswith(stem) for text, stem in zip(first, stems, strict=True))


def test_asking_for_more_than_the_set_has_is_an_error() -> None:
    with pytest.raises(ValueError, match="this set has"):
        chat_prompts(10**6, seed=0)
