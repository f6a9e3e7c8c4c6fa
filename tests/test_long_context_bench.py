"""bench.long_context's specserve side on the tiny model: one row per context, repeats kept."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import long_context


def test_each_context_gets_a_ttft_and_a_median_decode_rate(tiny_model_dir: Path) -> None:
    args = argparse.Namespace(
        model=str(tiny_model_dir), dtype="float32", quantization="none", threads=1,
        kv_cache_gib=0.02, contexts=[20, 40], max_tokens=5, batch=1, repeats=3,
    )  # fmt: skip
    table, batch_ratio, prompts = long_context.specserve_table(args)
    assert sorted(table) == [20, 40] and batch_ratio is None
    assert [len(p) for p in prompts] == [20, 40]
    for run in table.values():
        assert run.ttft_s > 0 and run.decode_tok_s > 0


def test_the_decode_rate_counts_intervals_between_tokens() -> None:
    assert long_context.decode_rate([1.0, 1.5, 2.0, 3.0]) == 1.5
