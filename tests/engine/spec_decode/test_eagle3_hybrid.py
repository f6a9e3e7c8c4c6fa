"""hybrid-eagle3: the n-gram proposer beside an EAGLE-3 head, as `hybrid` puts it beside a draft
model (engine/spec_decode/proposers/hybrid.py, the planner's `_head_option`)."""

from __future__ import annotations

from pathlib import Path

from engine_utils import greedy, hf_model, make_engine, outputs, random_prompts
from test_eagle3 import CYCLE, bigram_target, write_head

from engine.config import SpeculativeConfig

__all__ = ["bigram_target"]  # the fixture, shared with test_eagle3


def test_hybrid_eagle3_takes_ngram_matches_and_the_head_elsewhere(
    bigram_target: Path, tmp_path: Path
) -> None:
    """hybrid-eagle3: an n-gram match proposes where the text repeats, the head everywhere else
    (its catch-up over what the n-gram drafts covered), and greedy output stays plain's, with
    the planner and without."""
    vocab = hf_model(bigram_target).config.vocab_size
    head = write_head(tmp_path / "head", bigram_target, sorted({*CYCLE, *range(0, vocab, 7)}))
    repeated = random_prompts(2, (6, 10), vocab, seed=5)
    prompts = [p * 3 for p in repeated] + random_prompts(2, (3, 20), vocab, seed=74)
    want = outputs(make_engine(bigram_target), prompts, greedy(24))
    for adaptive in (False, True):
        spec = SpeculativeConfig(
            method="hybrid-eagle3",
            num_speculative_tokens=3,
            draft_model=str(head),
            adaptive=adaptive,
        )
        engine = make_engine(bigram_target, speculative=spec)
        seqs = engine.generate(prompts, greedy(24))
        assert [s.output_token_ids for s in seqs] == want
        sources = {name for s in seqs for name in s.spec.by_proposer}
        assert sources == {"ngram", "eagle3"}, (adaptive, sources)
