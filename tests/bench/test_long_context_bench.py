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
    table, batch_ratio, prompts, _ = long_context.specserve_table(args)
    assert sorted(table) == [20, 40] and batch_ratio is None
    assert [len(p) for p in prompts] == [20, 40]
    for run in table.values():
        assert run.ttft_s > 0 and run.decode_tok_s > 0


def test_paired_steps_give_each_longer_context_a_ratio(tiny_model_dir: Path) -> None:
    args = argparse.Namespace(
        model=str(tiny_model_dir), dtype="float32", quantization="none", threads=1,
        kv_cache_gib=0.02, contexts=[20, 40, 60], max_tokens=6, batch=1, repeats=1,
    )  # fmt: skip
    _, _, prompts, engine = long_context.specserve_table(args)
    ratios = long_context.paired_ratios(args, engine, prompts)
    assert sorted(ratios) == [40, 60]
    for median, q1, q3 in ratios.values():
        assert 0 < q1 <= median <= q3
    assert not engine.has_unfinished()  # each paired request ends with its pairs


def test_the_decode_rate_counts_intervals_between_tokens() -> None:
    assert long_context.decode_rate([1.0, 1.5, 2.0, 3.0]) == 1.5
