"""The CUDA path's decisions, checked on a CPU: kernels chosen per device, KV sizing on the
configured GPU, calibration that waits for the device, timing marks, current-device setting.
A fake device stands in where the real one would be asked (mem_get_info, synchronize)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.core import kv_sizing
from engine.model import device as devices
from engine.model.quant import kernels
from engine.model.quant.formats import quantize_int4, quantize_int8
from engine.model.quantization import quantization_for
from engine.model.runner import ModelRunner
from engine.spec_decode.step_cost import CostCurve, calibrate
from server.settings import Settings, SettingsError

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
GIB = 1 << 30


def _int8_weight() -> Any:
    return quantize_int8(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("passes", [0, 1, 2])
def test_cuda_never_selects_the_cpu_int8_kernels(passes: int) -> None:
    on_cuda = kernels._kernel_classes(_int8_weight(), torch.bfloat16, CUDA, passes)
    on_cpu = kernels._kernel_classes(_int8_weight(), torch.bfloat16, CPU, passes)
    assert on_cuda == []  # make_kernel then dequantizes: bf16 on cuBLAS
    assert kernels.Int8Kernel in on_cpu


def test_int4_on_cuda_takes_the_cuda_kernel() -> None:
    w = quantize_int4(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)), 32)
    assert kernels._kernel_classes(w, torch.bfloat16, CUDA, 0) == [kernels.Int4CudaKernel]


@pytest.mark.parametrize(
    ("asked", "on_cuda"),
    [("w8a8", "none"), ("w8a8-fast", "none"), ("auto", "none"), ("int8", "none"),
     ("int4", "int4"), ("none", "none")],
)  # fmt: skip
def test_quantization_for_the_device(asked: Any, on_cuda: str, caplog: Any) -> None:
    with caplog.at_level(logging.INFO, logger="specserve.quant"):
        assert quantization_for(asked, "cuda:1", "draft") == on_cuda
        assert quantization_for(asked, "cpu", "draft") == asked
    changed = [r for r in caplog.records if "load dense" in r.getMessage()]
    assert len(changed) == (asked != on_cuda)
    if changed:
        assert "draft" in changed[0].getMessage() and "cuda:1" in changed[0].getMessage()


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, free: float, total: float) -> list[str]:
    asked: list[str] = []

    def mem_get_info(device: str) -> tuple[int, int]:
        asked.append(str(device))
        return int(free * GIB), int(total * GIB)

    monkeypatch.setattr(devices, "mem_get_info", mem_get_info)
    return asked


def test_kv_pool_sized_on_the_configured_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_gpu(monkeypatch, free=60.0, total=80.0)  # 20 GiB already held (weights)
    config = EngineConfig(model="m", device="cuda:1", kv_cache_gib=8.0)
    assert kv_sizing.kv_budget_bytes(config) == 8.0 * GIB  # kv_cache_gib honoured on CUDA
    assert asked == ["cuda:1"]
    config = EngineConfig(model="m", device="cuda:1", kv_cache_gib=100.0)
    assert kv_sizing.kv_budget_bytes(config) == pytest.approx((0.85 * 80 - 20) * GIB)
    tight = EngineConfig(model="m", device="cuda:1", kv_cache_gib=100.0, gpu_memory_utilization=0.5)
    assert kv_sizing.kv_budget_bytes(tight) == pytest.approx((0.5 * 80 - 20) * GIB)
    assert kv_sizing.num_kv_blocks(config, bytes_per_block=GIB) == int(0.85 * 80 - 20)


def test_kv_pool_refused_when_the_gpu_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, free=10.0, total=80.0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_sizing.kv_budget_bytes(EngineConfig(model="m", device="cuda"))


def test_kv_pool_on_cpu_is_kv_cache_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_gpu(monkeypatch, free=1.0, total=1.0)
    assert kv_sizing.kv_budget_bytes(EngineConfig(model="m", kv_cache_gib=3.0)) == 3.0 * GIB
    assert asked == []


def test_gpu_memory_utilization_setting() -> None:
    config = Settings.load(model="m", gpu_memory_utilization="0.5").engine_config()
    assert config.gpu_memory_utilization == 0.5
    with pytest.raises(SettingsError, match="gpu_memory_utilization"):
        Settings.load(model="m", gpu_memory_utilization="1.5")


class _AsyncRunner:
    """A runner on a fake asynchronous device: forward returns at once and leaves `work_s` of
    work queued, which only `synchronize` waits for (as a CUDA stream would)."""

    device = torch.device("cuda:0")
    block_size = 16
    vocab_size = 100
    loaded = type("Loaded", (), {"name": "fake"})()

    def __init__(self, work_s: float) -> None:
        self.work_s = work_s
        self.queued = 0.0
        self.events: list[str] = []

    def forward(self, inputs: Any) -> None:
        self.queued += self.work_s
        self.events.append("forward")

    def synchronize(self, device: torch.device) -> None:
        assert device == self.device
        time.sleep(self.queued)
        self.queued = 0.0
        self.events.append("sync")


def test_calibration_times_the_device_work(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _AsyncRunner(work_s=0.02)
    monkeypatch.setattr(devices, "synchronize", runner.synchronize)
    curve = CostCurve()
    calibrate(curve, runner, [1, 2], num_blocks=8, rounds=1)  # type: ignore[arg-type]
    assert runner.events == ["sync", "forward", "sync"] * 3  # warm-up, then 1 and 2 rows
    assert min(curve.points.values()) >= 0.02  # without the waits: microseconds


class _FakeEvent:
    def __init__(self, at_ms: float) -> None:
        self.at_ms, self.waited = at_ms, False

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, other: _FakeEvent) -> float:
        return other.at_ms - self.at_ms


def test_timing_marks_read_device_events() -> None:
    start, stop = _FakeEvent(5.0), _FakeEvent(17.0)
    seconds = devices.elapsed_seconds(
        devices.TimingMark(0.0, start),  # type: ignore[arg-type]
        devices.TimingMark(100.0, stop),  # type: ignore[arg-type]
    )
    assert seconds == pytest.approx(0.012) and stop.waited  # the device's time, not the host's
    cpu = devices.elapsed_seconds(devices.TimingMark(1.0), devices.TimingMark(1.25))
    assert cpu == 0.25


def test_make_current_sets_the_thread_device(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for device in ("cuda:1", "cuda", "cpu"):
        devices.make_current(device)
    assert chosen == [1, 0]


def test_runner_timings_on_cpu(tiny_model_dir: Path) -> None:
    from engine.model.loader import load_model
    from engine.model.runner import ForwardInput

    runner = ModelRunner(load_model(str(tiny_model_dir)), "cpu", "float32", 4)
    runner.allocate_kv_cache(8)
    runner.timings = []
    runner.forward([ForwardInput([5, 6, 7], 0, [0], 1)])
    runner.forward([ForwardInput([8], 3, [0], 1)])
    taken = runner.take_timings()
    assert [rows for rows, _ in taken] == [3, 1] and all(s > 0 for _, s in taken)
    assert runner.take_timings() == []
