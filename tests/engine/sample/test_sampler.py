"""The sampler against hand computations and a numpy reference, plus statistical checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sample import sampler
from engine.sample.sampler import (
    logprobs_of,
    processed_probs,
    sample,
    verification_histories,
)
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import SeedStream


def reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """One row, written the slow obvious way: temperature, top-k, top-p, min-p, softmax."""
    x = logits.astype(np.float64) / params.temperature
    keep = np.ones_like(x, dtype=bool)
    if 0 < params.top_k < len(x):
        keep[np.argsort(-x)[params.top_k :]] = False
    probs = _softmax(np.where(keep, x, -np.inf))
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    keep[order[mass_before >= params.top_p]] = False
    probs = _softmax(np.where(keep, x, -np.inf))
    keep &= probs >= params.min_p * probs.max()
    return _softmax(np.where(keep, x, -np.inf))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def total_variation(samples: list[int], expected: np.ndarray) -> float:
    observed = np.bincount(samples, minlength=len(expected)) / len(samples)
    return 0.5 * float(np.abs(observed - expected).sum())


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 3.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    probs = processed_probs(logits, [params], [[1, 1, 3, 1]])
    # token 1: seen 3 times -> 2.0 - 0.5 - 0.75; token 3: once -> -1.0 - 0.5 - 0.25
    expected = torch.softmax(torch.tensor([[1.0, 0.75, 0.5, -1.75, 3.0]]), dim=-1)
    torch.testing.assert_close(probs, expected)


def test_negative_penalties_and_rows_without_penalties() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    params = [SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), SamplingParams()]
    probs = processed_probs(logits, params, [[2, 2], [2, 2]])
    expected_0 = torch.softmax(torch.tensor([0.0, 0.0, 2.0]), dim=-1)
    torch.testing.assert_close(probs[0], expected_0)
    torch.testing.assert_close(probs[1], torch.full((3,), 1 / 3))


def test_verification_histories_count_earlier_drafts() -> None:
    assert verification_histories([5], [1, 2]) == [[5], [5, 1], [5, 1, 2]]
    logits = torch.zeros(3, 4)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)] * 3
    probs = processed_probs(logits, params, verification_histories([0], [1, 2]))
    # each position's argmax moves past the tokens already counted
    assert probs.argmax(dim=-1).tolist() == [1, 2, 3]


PARAM_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=1.5, top_k=20, top_p=0.9, min_p=0.05),
    SamplingParams(top_k=-1, top_p=1.0),
    SamplingParams(top_k=1),
]


@pytest.mark.parametrize("num_candidates", [4, 12, 1024])
def test_masks_match_numpy_reference(num_candidates: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few candidates force both the partial path and the full-sort fallback."""
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", num_candidates)
    gen = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(len(PARAM_CASES), 50, generator=gen)
    probs = processed_probs(logits, PARAM_CASES, [[] for _ in PARAM_CASES])
    for row, params in enumerate(PARAM_CASES):
        expected = reference_probs(logits[row].numpy(), params)
        np.testing.assert_allclose(probs[row].numpy(), expected, atol=1e-6, err_msg=str(params))
        assert ((probs[row] > 0).numpy() == (expected > 0)).all(), params


def test_large_vocab_nucleus_matches_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = 6.0 * torch.randn(4, 20_000, generator=gen)
    logits[3] *= 0.05  # flat: the nucleus reaches past the candidates, so the full sort runs
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=3000)]
    params += [SamplingParams(temperature=0.7, top_p=0.95), SamplingParams(top_p=0.5)]
    probs = processed_probs(logits, params, [[]] * 4).numpy()
    for row, p in enumerate(params):
        expected = reference_probs(logits[row].numpy(), p)
        # float32 cumsums may move the boundary of a huge nucleus by a token
        assert ((probs[row] > 0) != (expected > 0)).sum() <= (1 if row == 3 else 0), p
        assert 0.5 * np.abs(probs[row] - expected).sum() < 1e-4, p
    assert (probs[3] > 0).sum() > 2 * sampler.NUCLEUS_CANDIDATES


def test_penalties_leave_the_input_untouched() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0]).expand(2, -1)  # non-contiguous view
    before = logits.clone()
    params = [SamplingParams(frequency_penalty=1.0, temperature=0.0)] * 2
    probs = processed_probs(logits, params, [[2, 2], []])
    assert torch.equal(logits, before)
    assert probs.argmax(dim=-1).tolist() == [1, 2]


def test_greedy_rows_are_one_hot_on_penalized_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0, top_k=1),
        SamplingParams(temperature=1.0),
    ]
    probs = processed_probs(logits, params, [[1], [1], [1]])
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    assert probs[1].tolist() == [0.0, 0.0, 1.0]
    torch.testing.assert_close(probs[2], torch.softmax(logits[2], dim=-1))
    assert sample(probs[:2], [None, SeedStream.of(3, 0).row_keys(0, 1)[0]]) == [1, 2]


def test_greedy_sample_is_exact_argmax_over_many_draws() -> None:
    logits = torch.randn(2000, 300, generator=torch.Generator().manual_seed(1))
    probs = processed_probs(logits, [SamplingParams(temperature=0.0)] * 2000, [[]] * 2000)
    assert sample(probs, [None] * 2000) == logits.argmax(dim=-1).tolist()


def _run_seeded(rows: list[tuple[SamplingParams, int | None]], steps: int) -> list[list[int]]:
    """Decode `steps` tokens for a batch; every row sees the same per-step logits stream."""
    logit_gen = torch.Generator().manual_seed(123)
    step_logits = [torch.randn(64, generator=logit_gen) for _ in range(steps)]
    streams = [None if s is None else SeedStream.of(s, 0) for _, s in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    for position, logits in enumerate(step_logits):
        batch = logits.expand(len(rows), -1)
        probs = processed_probs(batch, [p for p, _ in rows], outputs)
        keys = [None if s is None else s.row_keys(position, 1)[0] for s in streams]
        for out, token in zip(outputs, sample(probs, keys), strict=True):
            out.append(token)
    return outputs


def test_seeded_request_is_reproducible_whatever_the_batch() -> None:
    request = (SamplingParams(temperature=1.0, top_p=0.9, frequency_penalty=0.3), 42)
    alone = _run_seeded([request], steps=30)[0]
    others = [
        (SamplingParams(temperature=0.5), None),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(top_k=3), 7),
    ]
    in_batch = _run_seeded([others[0], request, *others[1:]], steps=30)[1]
    assert alone == in_batch
    assert alone != _run_seeded([(request[0], 43)], steps=30)[0]


STAT_CASES = [
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.4),
    SamplingParams(top_k=3),
    SamplingParams(top_p=0.7),
    SamplingParams(temperature=0.8, top_k=6, top_p=0.85, min_p=0.05),
]


@pytest.mark.parametrize(
    "params", STAT_CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"
)
def test_sample_matches_expected_distribution(params: SamplingParams) -> None:
    num_draws = 100_000
    logits = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, 0.9, -1.5, 1.6, 0.1, -0.2])
    expected = reference_probs(logits.numpy(), params)
    probs = processed_probs(logits.expand(num_draws, -1), [params] * num_draws, [[]] * num_draws)
    torch.manual_seed(0)
    assert total_variation(sample(probs, [None] * num_draws), expected) < 0.01
    seeded = SeedStream.of(1, 0).row_keys(0, num_draws // 5)  # one draw per position
    assert total_variation(sample(probs[: len(seeded)], seeded), expected) < 0.02


def test_logprobs_equal_log_softmax_of_raw_logits() -> None:
    logits = 3.0 * torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    chosen = [0, 5, 29, 7]
    reference = torch.log_softmax(logits, dim=-1)
    results = logprobs_of(logits, chosen, num_top=3)
    for row, (token, result) in enumerate(zip(chosen, results, strict=True)):
        assert result.token_id == token
        assert result.logprob == pytest.approx(reference[row, token].item(), abs=1e-6)
        top_ids = reference[row].argsort(descending=True)[:3].tolist()
        assert [t for t, _ in result.top] == top_ids
        for t, lp in result.top:
            assert lp == pytest.approx(reference[row, t].item(), abs=1e-6)
    assert all(r.top == () for r in logprobs_of(logits, chosen, num_top=0))
