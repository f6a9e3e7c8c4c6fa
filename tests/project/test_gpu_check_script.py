"""scripts/gpu_check.sh, the first run on a GPU, walked on this CPU: its dry run takes every step
at small shapes (the GPU tests are collected and skipped) and writes each result file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("gpu_check.sh", "gpu_wheels.sh")
STEPS = (
    "- nvidia-smi: ok", "- gpu tests: ok", "- env, kernels, pair shapes: ok", "  - env: ok",
    "  - kernels: ok", "  - shapes: ok", "- bench (dry run: config and flags only): ok",
)  # fmt: skip


def test_scripts_parse() -> None:
    for name in SCRIPTS:
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], check=True)


def test_dry_run_walks_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert run.returncode == 0, report + run.stderr[-3000:]
    for step in STEPS:
        assert step in report, report
    env_txt = (tmp_path / "env.txt").read_text()
    assert "nvidia-smi: not found" in env_txt and "cuda available False" in env_txt
    assert "skipped" in (tmp_path / "tests.txt").read_text()
    kernels = (tmp_path / "kernels.md").read_text()
    for matrix in ("qkv", "o", "gate_up", "down", "head"):
        assert f"| {matrix} |" in kernels
    shapes = (tmp_path / "shapes.md").read_text()
    assert "| target 1.5B |" in shapes and "| draft 0.5B |" in shapes and "speedup" in shapes
    assert len(list(tmp_path.iterdir())) <= 8  # what a device run brings back


def test_an_unknown_argument_is_refused(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--devcie", "cpu"],
        env={**os.environ, "OUT": str(tmp_path)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2 and "unknown argument --devcie" in run.stderr
