"""The hybrid Qwen3.5's verify cost against its rows: one request's forward of its last token plus
k drafts (rows = k + 1, the state kept after each), after a prompt, on a random model of a
Qwen3.5 size's shape (no checkpoint is downloaded). Alternating rounds, medians.

    python -m bench.hybrid_verify --layers 24 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.model.loader import load_model
from engine.model.runner import ForwardInput, ModelRunner

# Qwen3.5-0.8B's text model (hidden 1024; 3 of 4 layers Gated DeltaNet, 16 heads of 128)
SHAPE = dict(
    hidden_size=1024,
    num_heads=8,
    num_kv_heads=2,
    head_dim=256,
    intermediate_size=3584,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)


def _model(folder: Path, layers: int) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import make_tiny_qwen3_5  # the tests' builder: random weights, tiny tokenizer

    return make_tiny_qwen3_5(folder, seed=0, num_layers=layers, **SHAPE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        runner = ModelRunner(load_model(str(_model(Path(tmp), args.layers))), "cpu", args.dtype, 16)
    runner.allocate_kv_cache(64)
    runner.allocate_states(1)
    table, prompt = list(range(64)), list(range(3, 131))
    runner.forward([ForwardInput(prompt, 0, table, 1, state_slot=0)])
    times: dict[int, list[float]] = {rows: [] for rows in (1, 2, 4, 8)}
    for r in range(args.rounds + 1):
        for rows in times if r % 2 else reversed(list(times)):
            start = time.perf_counter()
            runner.forward(
                [ForwardInput([5] * rows, len(prompt), table, rows, rows - 1, state_slot=0)]
            )
            if r:  # the first round warms up
                times[rows].append(time.perf_counter() - start)
            # no commit: the next forward forgets the candidates, the slot stays at the prompt
    base = statistics.median(times[1])
    for rows, seconds in times.items():
        median = statistics.median(seconds)
        print(f"rows {rows}: {median * 1e3:.1f} ms ({median / base:.2f}x one row)")


if __name__ == "__main__":
    main()
