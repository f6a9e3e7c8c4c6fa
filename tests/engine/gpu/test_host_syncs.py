"""No host sync per drafted token: on a GPU a step reads the device a fixed number of times
whatever k and the batch size (the draft's picks come back in one copy, the verified tokens in
another). Checked on a CPU by running the GPU's code path (`host_syncs_free` answers False) and
counting every tensor-to-host read a step makes; the drafts it makes must equal the CPU loop's."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_utils import greedy, make_engine, outputs, random_prompts

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.model import device as devices
from engine.sample.sampling_params import SamplingParams

# Tensor methods that hand a value to the host: each is a device sync on a GPU.
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
# Per step: the draft's picks (one copy) and the verified tokens (one copy).
MAX_READS_PER_STEP = 2
VOCAB = 64


@pytest.fixture
def gpu_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The code paths a GPU takes, on this CPU."""
    monkeypatch.setattr(devices, "host_syncs_free", lambda device: False)


@contextmanager
def count_host_reads() -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](self, *args, **kwargs)

        return read

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counting(name))
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _draft_engine(model: Path, draft: Path, k: int, p_min: float = 0.0) -> LLMEngine:
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=k, draft_model=str(draft), adaptive=False,
        draft_p_min=p_min,
    )  # fmt: skip
    return make_engine(model, speculative=spec)


def _reads_per_decode_step(
    engine: LLMEngine, batch: int, params: list[SamplingParams] | None = None
) -> list[int]:
    prompts = random_prompts(batch, (5, 9), VOCAB, seed=batch)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i] if params else greedy(10))
    engine.step()  # the prompts
    engine.step()  # the draft catches up on them
    reads = []
    while engine.has_unfinished():
        with count_host_reads() as counts:
            engine.step()
        reads.append(sum(counts.values()))
    return reads


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("batch", [1, 4])
def test_host_reads_per_step_do_not_grow_with_k_or_batch(
    gpu_policy: None, tiny_model_dir: Path, tiny_draft_dir: Path, k: int, batch: int
) -> None:
    engine = _draft_engine(tiny_model_dir, tiny_draft_dir, k)
    reads = _reads_per_decode_step(engine, batch)
    assert reads and max(reads) <= MAX_READS_PER_STEP, reads


SAMPLED = [
    SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.7, top_k=5, min_p=0.05, ignore_eos=True),
    greedy(10),
]


@pytest.mark.parametrize("logprobs", [False, True])
def test_sampled_requests_read_alike(
    gpu_policy: None, tiny_model_dir: Path, tiny_draft_dir: Path, logprobs: bool
) -> None:
    """Seeded, top-p, top-k and min-p requests cost no read of their own; logprobs one copy."""
    params = [*SAMPLED[:3], greedy(10, logprobs=2) if logprobs else SAMPLED[3]]
    engine = _draft_engine(tiny_model_dir, tiny_draft_dir, k=3)
    reads = _reads_per_decode_step(engine, 4, params)
    assert max(reads) <= MAX_READS_PER_STEP + logprobs, reads


def test_the_cpu_loop_reads_per_token(tiny_model_dir: Path, tiny_draft_dir: Path) -> None:
    """The counter sees the CPU's per-token reads: the bound above is not vacuous."""
    engine = _draft_engine(tiny_model_dir, tiny_draft_dir, k=4)
    assert max(_reads_per_decode_step(engine, 4)) > MAX_READS_PER_STEP


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> Any:
    torch.manual_seed(0)
    seqs = engine.generate(prompts, params)
    return [(s.output_token_ids, s.spec.num_draft_tokens, s.spec.num_accepted_tokens) for s in seqs]


@pytest.mark.parametrize("p_min", [0.0, 0.5])
def test_drafts_on_device_equal_the_cpu_loop(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, tiny_draft_dir: Path, p_min: float
) -> None:
    engine = _draft_engine(tiny_model_dir, tiny_draft_dir, k=4, p_min=p_min)
    prompts = random_prompts(5, (3, 20), VOCAB, seed=7)
    params = [greedy(12), greedy(12, num_speculative_tokens=2), greedy(12)]
    if p_min == 0.0:  # sampled rows draw alike only where both loops run the same rows
        params += [
            SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True),
        ]
    prompts = prompts[: len(params)]
    on_cpu = _run(engine, prompts, params)
    monkeypatch.setattr(devices, "host_syncs_free", lambda device: False)
    assert _run(engine, prompts, params) == on_cpu
    plain = make_engine(tiny_model_dir)
    assert [o for o, _, _ in on_cpu[:3]] == outputs(plain, prompts[:3], greedy(12))
    assert sum(drafted for _, drafted, _ in on_cpu) > 0
