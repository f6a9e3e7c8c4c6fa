"""Which process this is in a tensor-parallel group, and the one collective the step needs.

vLLM keeps the same fact in its `parallel_state` module: the model runner asks it whether the
model it loads is sharded, so the engine above it stays unchanged. Only the target model is
sharded (`TensorParallel.model` names it); the draft runs whole on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    model: str  # the model spec (EngineConfig.model) whose runner is sharded

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples, verifies and runs the draft; the others only run forwards."""
        return self.rank == 0

    def lead(self, op: str, *args: Any) -> None:
        """On rank 0: tell the other ranks to do `op(*args)` on their shard, as rank 0 is about
        to; elsewhere a no-op (the worker loop is already doing it)."""
        if self.is_driver:
            dist.broadcast_object_list([(op, args)], src=0)

    def follow(self) -> tuple[str, tuple[Any, ...]]:
        """On the other ranks: the next operation rank 0 leads."""
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        op, args = message[0]
        return op, args

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x


_current: TensorParallel | None = None


def set_tensor_parallel(tp: TensorParallel | None) -> None:
    global _current
    _current = tp


def tensor_parallel_for(model: str) -> TensorParallel | None:
    """The group that shards `model` in this process, if any."""
    return _current if _current is not None and _current.model == model else None
