"""Large CPU buffers on 2 MB pages (engine/kernels/memory.py, csrc/memory.h)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.kernels import build, memory

ROOT = Path(__file__).resolve().parents[3]


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "never"


def test_empty_huge_is_an_ordinary_tensor() -> None:
    t = memory.empty_huge((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    t.zero_()
    assert t.sum().item() == 0


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this host")
@pytest.mark.skipif(not build.load(), reason="native kernels not built on this host")
def test_a_large_buffer_lands_on_huge_pages() -> None:
    """In a fresh process: in a long-lived one (a test worker) the allocator may hand back pages
    an earlier test already touched, which the advice cannot turn huge."""
    script = textwrap.dedent("""
        import re, torch
        from pathlib import Path
        from engine.kernels import memory
        def huge_kib():
            text = Path("/proc/self/smaps_rollup").read_text()
            return int(re.search(r"AnonHugePages:\\s+(\\d+)", text).group(1))
        def fallbacks():
            text = Path("/proc/vmstat").read_text()
            return int(re.search(r"thp_fault_fallback (\\d+)", text).group(1))
        before, fell = huge_kib(), fallbacks()
        t = memory.empty_huge((64 << 20,), torch.uint8)
        t.fill_(1)
        print(huge_kib() - before, fallbacks() - fell)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    gained_kib, fallbacks = map(int, out.stdout.split()[-2:])
    if gained_kib < 32 << 10 and fallbacks:
        # the kernel was asked (the advice worked) but had no free 2 MiB page to give
        pytest.skip("the kernel fell back to 4 KiB pages: no free 2 MiB pages on this host now")
    assert gained_kib >= 32 << 10  # at least half of its 64 MiB on 2 MiB pages
