"""bench.step_profile on the tiny model: a step's time split by kind, attention among them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import step_profile


def test_a_decode_step_splits_into_kinds_that_add_up(tiny_model_dir: Path) -> None:
    args = argparse.Namespace(
        model=str(tiny_model_dir), dtype="float32", quantization="none", threads=1,
        batch=2, context=40, steps=2, kv_cache_gib=0.02,
    )  # fmt: skip
    engine = step_profile.engine_for(args)
    step_profile.start_decoding(engine, args.batch, args.context, args.steps)
    assert all(s.num_uncomputed_tokens == 1 for s in engine.scheduler.running)
    wall, kinds = step_profile.profile_steps(engine, args.steps)
    assert set(kinds) == {"GEMMs", "attention", "other ops", "host"}
    assert kinds["GEMMs"] > 0 and kinds["attention"] > 0 and kinds["other ops"] > 0
    assert abs(sum(kinds.values()) - wall) < 0.05 * wall or kinds["host"] == 0.0
    assert step_profile.decoder.paged_attention is step_profile.attention.paged_attention
    assert step_profile.decoder.attend is step_profile.attention.attend


def test_the_cold_attention_step_is_timed_per_kernel_variant() -> None:
    if not step_profile.attention_ops.available():
        pytest.skip("native kernels not built on this host")
    ms = step_profile.cold_step_ms(40, repeats=2, isas=("auto", "scalar"), rows=3, layers=2)
    assert set(ms) == {"auto", "scalar"} and all(v > 0 for v in ms.values())


def test_the_bandwidth_share_counts_every_native_matrix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf_blocks import write_random_gguf
    from tiny import make_tiny_model

    from engine.kernels import gguf_ops

    if not gguf_ops.available():
        pytest.skip("native kernels not built on this host")
    src = make_tiny_model(tmp_path / "src", hidden_size=256, intermediate_size=512)
    path = tmp_path / "tiny.gguf"
    write_random_gguf(path, src, [T.Q4_K, T.Q6_K])
    args = argparse.Namespace(
        model=str(path), dtype="bfloat16", quantization="gguf", threads=1,
        batch=1, context=20, steps=2, rounds=1, kv_cache_gib=0.02,
    )  # fmt: skip
    step_profile.bandwidth_report(args)
    out = capsys.readouterr().out
    # 2 layers x (qkv, o, gate_up, down) + the untied head... or the tied table's head
    engine = step_profile.engine_for(args)
    matrices = [
        k
        for m in engine.target.model.modules()
        for k in [*(getattr(m, "kernels", None) or []), getattr(m, "head", None)]
        if isinstance(k, step_profile.GgufKernel)
    ]
    assert len(matrices) >= 2 * 4 + 1
    assert step_profile.streamed_bytes(engine) == sum(k.blocks.numel() for k in matrices)
    assert "| 1 |" in out and "median share:" in out
