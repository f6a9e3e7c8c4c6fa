"""The native layer stack against the Python layer loop it replaces, from one cache state."""

from __future__ import annotations

import torch

from engine.model.runner import ForwardInput, ModelRunner


def stack_and_loop_agree(runner: ModelRunner, inputs: list[ForwardInput]) -> list[bool]:
    """Logits and every K/V cache from the Python loop, then from the stack, from the same cache
    state: per tensor, whether the two are bit for bit equal (the stack left in place)."""
    stack = runner.model.native_stack
    caches = [c for kv in runner.kv_caches for c in kv]
    before = [c.clone() for c in caches]
    results = []
    for native in (False, True):
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        runner.model.native_stack = stack if native else None
        results.append([runner.forward(inputs), *[c.clone() for c in caches]])
    runner.model.native_stack = stack
    return [torch.equal(a, b) for a, b in zip(*results, strict=True)]  # type: ignore[misc]
