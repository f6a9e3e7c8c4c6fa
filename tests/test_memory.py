"""Large CPU buffers on 2 MB pages (engine/kernels/memory.py, csrc/memory.h)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.kernels import build, memory


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "never"


def _huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_empty_huge_is_an_ordinary_tensor() -> None:
    t = memory.empty_huge((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    t.zero_()
    assert t.sum().item() == 0


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this host")
@pytest.mark.skipif(not build.load(), reason="native kernels not built on this host")
def test_a_large_buffer_lands_on_huge_pages() -> None:
    before = _huge_kib()
    t = memory.empty_huge((64 << 20,), torch.uint8)
    t.fill_(1)
    assert _huge_kib() - before >= 32 << 10  # at least half of its 64 MiB on 2 MiB pages
