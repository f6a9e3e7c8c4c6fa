"""How many KV blocks the pool gets: `kv_cache_gib` everywhere, and on CUDA no more than
`gpu_memory_utilization` of the configured device allows (vLLM's meaning: the share of the whole
GPU this process may hold, weights included, measured after the weights are loaded)."""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.model import device as devices

log = logging.getLogger("specserve.engine")
GIB = 1 << 30


def num_kv_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """Blocks for target and draft together (`bytes_per_block` counts both pools)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    budget = kv_budget_bytes(config)
    return max(1, int(budget // bytes_per_block))


def kv_budget_bytes(config: EngineConfig) -> float:
    wanted = config.kv_cache_gib * GIB
    if not devices.is_cuda(config.device):
        return wanted
    free, total = devices.mem_get_info(config.device)
    allowed = total * config.gpu_memory_utilization - (total - free)
    if allowed <= 0:
        raise ValueError(
            f"{config.device} already holds {(total - free) / GIB:.1f} GiB of {total / GIB:.1f} "
            f"GiB, beyond gpu_memory_utilization {config.gpu_memory_utilization}: no room for "
            "a KV pool (raise gpu_memory_utilization or free the GPU)"
        )
    if allowed < wanted:
        log.info(
            "KV pool: %.2f GiB (gpu_memory_utilization %.2f of %s), below kv_cache_gib %.2f",
            allowed / GIB, config.gpu_memory_utilization, config.device, config.kv_cache_gib,
        )  # fmt: skip
    return min(wanted, allowed)
