"""Counter-based seeded noise: exact bits, exact Gumbel-max sampling, independence of the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine.sample import seeded
from engine.sample.sampler import processed_probs, sample
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import SeedStream, counter_bits, exponential_at, gumbel_max
from engine.spec_decode.rejection_sampler import verify_batch

CPU = torch.device("cpu")
M32 = 0xFFFFFFFF


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _reference_bits(row_key: int, token: int) -> int:
    """The hash in Python integers, as documented in engine/sample/seeded.py."""
    lo, hi = row_key & M32, (row_key >> 32) & M32
    return _lowbias32(((_lowbias32((token * 0x9E3779B9) & M32) ^ lo) + hi) & M32)


def test_bits_equal_the_python_reference() -> None:
    """int32 tensor ops (wrapping products, masked shifts) give exactly the documented hash."""
    keys = [*SeedStream.of(3, 1).row_keys(0, 3), (1 << 64) - 1, 0]
    tokens = torch.tensor([0, 1, 2, 399, 65_535, 151_935])
    got = counter_bits(keys, 151_936, CPU, tokens.expand(len(keys), -1)).long() & M32  # unsigned
    want = [[_reference_bits(k, t) for t in tokens.tolist()] for k in keys]
    assert got.tolist() == want


def test_noise_ignores_batch_position_and_rows_per_call() -> None:
    """A position's noise is the same whatever rows share the call and however many positions it
    computes; seed, choice and position each change it."""
    stream = SeedStream.of(11, 0)
    assert stream.row_keys(5, 4) == stream.row_keys(5, 1) + stream.row_keys(6, 3)
    keys = stream.row_keys(0, 6)
    together = exponential_at(keys, 300, CPU)  # [6, 300]
    alone = exponential_at(keys[3:4], 300, CPU)
    shuffled = exponential_at([keys[5], keys[3], *SeedStream.of(9, 0).row_keys(0, 2)], 300, CPU)
    assert torch.equal(together[3], alone[0]) and torch.equal(together[3], shuffled[1])
    # A narrower vocabulary (a draft's limited head) draws the same noise for the same tokens.
    assert torch.equal(exponential_at(keys, 120, CPU), together[:, :120])
    others = [SeedStream.of(12, 0).key, SeedStream.of(11, 1).key, stream.row_keys(6, 1)[0]]
    assert len({stream.key, *others}) == 4 and stream.row_keys(5, 1)[0] not in others


def test_noise_is_uniform_and_uncorrelated() -> None:
    """Exp(1) marginals (KS on 1 - exp(-E)), and no correlation between neighbouring positions,
    seeds or tokens."""
    noise = exponential_at(SeedStream.of(0, 0).row_keys(0, 64), 4_000, CPU).double()  # [64, 4000]
    u = 1.0 - torch.exp(-noise)
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 0.01
    neighbours = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    tokens = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    seeds = exponential_at(SeedStream.of(1, 0).row_keys(0, 64), 4_000, CPU).double()
    across = torch.corrcoef(torch.stack([u.flatten(), 1.0 - torch.exp(-seeds).flatten()]))[0, 1]
    assert max(abs(float(c)) for c in (neighbours, tokens, across)) < 0.01


def _draws(probs: torch.Tensor, num_seeds: int, num_positions: int) -> np.ndarray:
    """Gumbel-max draws at one fixed context, one per (seed, position)."""
    keys = [k for s in range(num_seeds) for k in SeedStream.of(s, 0).row_keys(0, num_positions)]
    tokens = gumbel_max(probs.expand(len(keys), -1), keys)
    return np.bincount(tokens.numpy(), minlength=probs.shape[-1])


LOGITS = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, 0.9, -1.5, 1.6, 0.1, -0.2, -3.0, 0.5])


def _chi_square(observed: np.ndarray, probs: torch.Tensor) -> float:
    dist = probs.double().numpy()
    expected = dist / dist.sum() * observed.sum()
    support = expected > 0
    assert observed[~support].sum() == 0  # nothing outside the processed support
    return float(stats.chisquare(observed[support], expected[support]).pvalue)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8)],
    ids=["t1", "t0.7-p0.8"],
)
def test_gumbel_max_samples_the_processed_distribution(params: SamplingParams) -> None:
    """24,000 draws across 8 seeds x 3,000 positions: chi-square at p > 0.01. The draws are fixed
    by the seeds, so the test is deterministic; the control shows it can fail."""
    probs = processed_probs(LOGITS[None], [params], [[]])[0]  # [V]
    observed = _draws(probs, num_seeds=8, num_positions=3_000)
    assert observed.sum() == 24_000
    assert _chi_square(observed, probs) > 0.01
    raw = torch.softmax(LOGITS.double() / 1.2, dim=-1).numpy()  # control: a close distribution
    assert stats.chisquare(observed, raw * observed.sum()).pvalue < 1e-6


def test_sparse_race_equals_the_full_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """Racing over a top-p row's support only picks what racing over the whole vocabulary does."""
    logits = 3.0 * torch.randn(40, 2_000, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.8, top_p=0.5)] * 40
    probs = processed_probs(logits, params, [[]] * 40)
    keys = SeedStream.of(5, 0).row_keys(0, 40)
    assert int((probs > 0).sum(dim=-1).max()) <= seeded.SPARSE_MAX_SUPPORT
    sparse = gumbel_max(probs, keys)
    monkeypatch.setattr(seeded, "SPARSE_MAX_SUPPORT", 0)  # never sparse
    assert torch.equal(sparse, gumbel_max(probs, keys))


def test_seeded_rows_ignore_the_global_rng_and_the_other_rows() -> None:
    probs = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(1)), -1)
    keys = SeedStream.of(7, 0).row_keys(0, 6)
    torch.manual_seed(0)
    first = sample(probs, keys)
    torch.manual_seed(1)
    mixed = sample(probs, [keys[0], None, keys[2], None, keys[4], None])
    assert [mixed[i] for i in (0, 2, 4)] == [first[i] for i in (0, 2, 4)]
    assert first == gumbel_max(probs, keys).tolist()


def test_one_batch_verifies_unseeded_by_rejection_and_seeded_by_matching() -> None:
    """Drafts drawn from q = p independently of the noise: rejection sampling accepts every one
    (p / q = 1), matching only those that happen to be the target's Gumbel-max token
    (probability sum p^2), in the same batched verification."""
    trials, params = 400, SamplingParams(temperature=1.0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 2)  # [k + 1 = 2, V]
    p = torch.softmax(logits, dim=-1)
    drafts = torch.multinomial(
        p[0], trials, replacement=True, generator=torch.Generator().manual_seed(2)
    )
    keys = [SeedStream.of(s, 0).row_keys(0, 2) for s in range(trials)]
    tokens = verify_batch(
        logits.repeat(2 * trials, 1),
        [[d] for d in drafts.tolist()] * 2,
        [p[:1]] * (2 * trials),
        [params] * (2 * trials),
        [[]] * (2 * trials),
        [None] * trials + keys,
    )
    unseeded, seeded_runs = tokens[:trials], tokens[trials:]
    assert all(len(t) == 2 for t in unseeded)
    own = [gumbel_max(p, k)[0].item() for k in keys]
    assert [len(t) == 2 for t in seeded_runs] == [
        d == o for d, o in zip(drafts.tolist(), own, strict=True)
    ]
    assert [t[0] for t in seeded_runs] == own  # the first token is the target's own, always
    assert 0.2 < sum(len(t) == 2 for t in seeded_runs) / trials < 0.5  # sum p^2 = 0.38
