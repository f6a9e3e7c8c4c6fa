"""The native kernel library builds with torch's extension machinery and dispatches on the running CPU."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import build

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


def cpuinfo_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the fallback is tested below")
def test_library_builds_and_registers_its_ops():
    assert build.load(), "a machine with a compiler must build the native kernels"
    assert "cpu_supports" in build.ops()


@pytest.mark.skipif(
    not HAS_COMPILER or not Path("/proc/cpuinfo").exists(), reason="needs /proc/cpuinfo"
)
def test_isa_is_read_from_the_running_cpu():
    assert build.load()
    flags = cpuinfo_flags()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    tiers = {  # one vocabulary of tiers (csrc/isa.h), each a set of /proc/cpuinfo flags
        "avx2": avx2,
        "avxvnni": avx2 and "avx_vnni" in flags,
        "avx512": avx512,
        "avx512vnni": avx512 and "avx512_vnni" in flags,
        "avx512bf16": avx512 and "avx512_bf16" in flags,
    }
    for tier, expected in tiers.items():
        assert torch.ops.specserve_kernels.cpu_supports(tier) == expected, tier
    for name in ("no-such-feature", "avx512f"):  # a raw feature bit is no tier
        assert not torch.ops.specserve_kernels.cpu_supports(name)


def test_switched_off_means_not_loaded():
    code = "from engine.kernels import build; print(build.load())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"SPECSERVE_NATIVE_KERNELS": "0", "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[3],
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_a_failed_build_falls_back_with_one_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(build, "CSRC", tmp_path)
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setenv("SPECSERVE_KERNELS_CACHE", str(tmp_path / "cache"))
    build.load.cache_clear()
    try:
        assert build.load() is False
    finally:
        build.load.cache_clear()
    assert any("native kernels unavailable" in record.getMessage() for record in caplog.records)
