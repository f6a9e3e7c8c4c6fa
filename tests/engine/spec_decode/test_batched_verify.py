"""One batched verification per step equals the per-request reference and keeps the distribution."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_utils import greedy, hf_greedy, hf_model, make_engine, random_prompts
from scipy import stats
from torch import Tensor

from engine.config import SpeculativeConfig
from engine.outputs import TokenLogprob
from engine.sample import sampler
from engine.sample.sampler import (
    processed_probs,
    verification_histories,
    verification_penalty_pairs,
)
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import SeedStream
from engine.spec_decode import rejection_sampler
from engine.spec_decode.rejection_sampler import (
    SpecDecodeMetadata,
    verify,
    verify_batch,
    verify_seeded,
)

V = 40

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05),
    SamplingParams(min_p=0.1, presence_penalty=0.5),
    SamplingParams(temperature=0.8, frequency_penalty=-0.4, top_p=0.95),
]


@dataclass
class Request:
    params: SamplingParams
    seed: int | None
    logits: Tensor  # [k + 1, V] raw target logits
    drafts: list[int]
    draft_probs: Tensor | None  # [k, V]; None: one-hot drafts
    output: list[int]

    def row_keys(self) -> list[int] | None:
        """The seeded noise keys of its k + 1 verify rows (it has produced `output` so far)."""
        if self.seed is None or self.params.greedy:
            return None
        return SeedStream.of(self.seed, 0).row_keys(len(self.output), len(self.drafts) + 1)


def random_request(gen: torch.Generator, index: int, seeded: bool) -> Request:
    params = PARAMS[int(torch.randint(len(PARAMS), (), generator=gen))]
    k = int(torch.randint(0, 6, (), generator=gen))
    logits = 3.0 * torch.randn(k + 1, V, generator=gen)
    output = torch.randint(0, V, (int(torch.randint(0, 12, (), generator=gen)),), generator=gen)
    q = torch.softmax(logits[:k] + torch.randn(k, V, generator=gen), dim=-1)  # close to the target
    if torch.rand((), generator=gen) < 0.5:  # one-hot (n-gram): mostly the target's favourite
        guess = torch.randint(0, V, (k,), generator=gen)
        favourite = torch.rand(k, generator=gen) < 0.7
        drafts, draft_probs = torch.where(favourite, logits[:k].argmax(-1), guess), None
    else:
        drafts, draft_probs = torch.multinomial(q, 1, generator=gen).flatten(), q
    seed = 1000 + index if seeded else None
    return Request(params, seed, logits, drafts.tolist(), draft_probs, output.tolist())


def reference(req: Request) -> list[int]:
    """Today's per-request path: processed probs of the k + 1 rows, then verify."""
    k = len(req.drafts)
    history = verification_histories(req.output, req.drafts)
    probs = processed_probs(req.logits, [req.params] * (k + 1), history)
    keys = req.row_keys()
    if keys is not None:
        return verify_seeded(probs, req.drafts, keys)
    return verify(probs, req.drafts, req.draft_probs, req.params.greedy, None)


def batched(requests: list[Request]) -> list[list[int]]:
    return verify_batch(
        torch.cat([r.logits for r in requests]),
        [r.drafts for r in requests],
        [r.draft_probs for r in requests],
        [r.params for r in requests],
        [r.output for r in requests],
        [r.row_keys() for r in requests],
    )


@pytest.mark.parametrize(("num_candidates", "group_rows"), [(8, 3), (1024, 7), (1024, 10_000)])
def test_batched_equals_per_request_reference(
    num_candidates: int, group_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random ragged batches: greedy and seeded requests give exactly the reference's tokens;
    unseeded ones (which share draws) at least give a well-formed run. Few nucleus candidates
    force the top-p fallback; small CPU groups split the batch (a request may exceed a group)."""
    monkeypatch.setattr(sampler, "NUCLEUS_CANDIDATES", num_candidates)
    monkeypatch.setattr(rejection_sampler, "CPU_GROUP_BYTES", group_rows * 4 * V)
    gen = torch.Generator().manual_seed(num_candidates + group_rows)
    num_compared = num_accepted = 0
    for trial in range(60):
        size = int(torch.randint(1, 17, (), generator=gen))
        requests = [random_request(gen, i, seeded=trial % 3 > 0 or i % 2 == 0) for i in range(size)]
        got = batched(requests)
        for req, tokens in zip(requests, got, strict=True):
            assert 1 <= len(tokens) <= len(req.drafts) + 1
            assert tokens[:-1] == req.drafts[: len(tokens) - 1]
            if req.params.greedy or req.seed is not None:
                assert tokens == reference(req), (trial, req.params, req.drafts)
                num_compared += 1
                num_accepted += len(tokens) - 1
    assert num_compared > 400 and num_accepted > 200  # enough runs, with real acceptances


def test_seeded_request_ignores_the_rest_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(7)
    requests = [random_request(gen, i, seeded=i % 3 == 0) for i in range(12)]
    request = random_request(gen, 99, seeded=True)
    request.params = SamplingParams(temperature=1.1, top_p=0.9, frequency_penalty=0.2)
    alone = batched([request])[0]
    assert alone == reference(request) and len(request.drafts) > 0
    assert batched([*requests[:5], request, *requests[5:]])[5] == alone
    assert batched([request, *requests])[0] == alone


def test_all_greedy_batch_with_k_zero() -> None:
    logits = torch.tensor(
        [
            [0.0, 2.0, 1.0],
            [3.0, 0.0, 0.0],
            [0.0, 0.0, 5.0],
            [1.0, 0.0, 0.0],
            [0, 4.0, 0],
            [0, 0, 1.0],
        ]
    )
    params = [SamplingParams(temperature=0.0)] * 3
    got = verify_batch(logits, [[1, 0], [], [2]], [None] * 3, params, [[]] * 3, [None] * 3)
    # rows 0-2: drafts 1, 0 accepted, bonus 2; row 3: no drafts -> 0; rows 4-5: 2 rejected -> 1
    assert got == [[1, 0, 2], [0], [1]]
    assert verify_batch(logits[:0], [], [], [], [], []) == []
    with pytest.raises(ValueError, match="verify rows"):
        verify_batch(logits[:5], [[1, 0], [], [2]], [None] * 3, params, [[]] * 3, [None] * 3)


def test_penalty_pairs_equal_the_histories() -> None:
    """Counting (row, token) pairs directly gives the same multiset as the copied histories."""
    outputs, drafts, firsts = [[5, 5, 2], [], [1]], [[2, 7], [3], []], [0, 3, 5]
    rows, ids = verification_penalty_pairs(firsts, outputs, drafts)
    expected = []
    for first, out, d in zip(firsts, outputs, drafts, strict=True):
        for i, history in enumerate(verification_histories(out, d)):
            expected += [(first + i, t) for t in history]
    assert sorted(zip(rows.tolist(), ids.tolist(), strict=True)) == sorted(expected)


def test_metadata_layout() -> None:
    """vLLM's layout: cumulative draft counts, and each draft scored by its request's row."""
    metadata = SpecDecodeMetadata.from_drafts([[1, 2], [], [0], [3]], torch.device("cpu"))
    assert metadata.cu_num_draft_tokens.tolist() == [2, 2, 3, 4]
    assert metadata.first_rows == [0, 3, 4, 6] and metadata.num_tokens == 8
    assert metadata.target_rows.tolist() == [0, 1, 4, 6]
    assert metadata.draft_request.tolist() == [0, 0, 2, 3]
    assert metadata.draft_position.tolist() == [0, 1, 0, 0]
    assert [metadata.drafts_of(b) for b in range(4)] == [
        slice(0, 2),
        slice(2, 2),
        slice(2, 3),
        slice(3, 4),
    ]


TRIALS = 80_000
K = 3
SMALL_V = 8


def test_batched_emissions_follow_the_target_distribution() -> None:
    """Many requests in one batch, ragged k, dense and one-hot drafts, unseeded and seeded:
    the token emitted at each position follows the processed target distribution there."""
    gen = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.8, top_k=6)
    logits = 2.0 * torch.randn(K + 1, SMALL_V, generator=gen)  # the same target for every request
    target = processed_probs(logits, [params] * (K + 1), [[]] * (K + 1))  # [K + 1, V]
    noise = torch.softmax(2.0 * torch.randn(K, SMALL_V, generator=gen), dim=-1)
    q = 0.6 * target[:K] + 0.4 * noise  # [K, V] a draft that mostly agrees, some mass off-support
    ks = torch.randint(0, K + 1, (TRIALS,), generator=gen).tolist()
    dense_drafts = torch.multinomial(q, TRIALS, replacement=True, generator=gen).T  # [T, K]
    favourite = torch.rand(TRIALS, K, generator=gen) < 0.8
    guesses = torch.randint(0, SMALL_V, (TRIALS, K), generator=gen)
    one_hot_drafts = torch.where(favourite, target[:K].argmax(-1), guesses)
    is_dense = (torch.rand(TRIALS, generator=gen) < 0.5).tolist()
    drafts = [
        (dense_drafts if d else one_hot_drafts)[t, :k].tolist()
        for t, (k, d) in enumerate(zip(ks, is_dense, strict=True))
    ]
    torch.manual_seed(12)
    tokens = verify_batch(
        torch.cat([logits[: k + 1] for k in ks]),
        drafts,
        [q[:k] if d else None for k, d in zip(ks, is_dense, strict=True)],
        [params] * TRIALS,
        [[]] * TRIALS,
        [SeedStream.of(t, 0).row_keys(0, k + 1) if t % 10 == 0 else None for t, k in enumerate(ks)],
    )
    for pos in range(K + 1):
        emitted = [t[pos] for t in tokens if len(t) > pos]
        assert len(emitted) > 4_000, pos
        observed = np.bincount(emitted, minlength=SMALL_V)
        dist = target[pos].double().numpy()
        expected = dist / dist.sum() * len(emitted)
        support = expected > 0
        assert observed[~support].sum() == 0, pos  # nothing outside the top-k
        p_value = stats.chisquare(observed[support], expected[support]).pvalue
        assert p_value > 1e-4, (pos, p_value, observed, expected)


def test_engine_logprobs_of_batched_speculative_runs(tiny_model_dir: Path) -> None:
    """Self-draft (accepted runs of several tokens), three requests in one batch, different top-n,
    one also echoing its prompt (so verify rows are not contiguous): each sampled logprob equals
    transformers' log-softmax at its position."""
    spec = SpeculativeConfig(
        method="draft", num_speculative_tokens=3, adaptive=False, draft_model=str(tiny_model_dir)
    )
    engine = make_engine(tiny_model_dir, speculative=spec)
    vocab = hf_model(tiny_model_dir).config.vocab_size
    prompts = random_prompts(3, (5, 12), vocab, seed=71)
    params = [greedy(8, logprobs=3), greedy(8, logprobs=1, prompt_logprobs=2), greedy(8)]
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    logprobs: dict[str, list[TokenLogprob]] = {f"r{i}": [] for i in range(3)}
    num_accepted = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs or []
            num_accepted += out.spec.num_accepted_tokens if out.finished else 0
    assert num_accepted > 0
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        out_tokens, out_logprobs = tokens[f"r{i}"], logprobs[f"r{i}"]
        assert out_tokens == hf_greedy(tiny_model_dir, prompt, 8)
        if p.logprobs is None:
            assert out_logprobs == []
            continue
        full = torch.tensor([prompt + out_tokens])
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(tiny_model_dir)(full).logits[0].float(), dim=-1)
        assert len(out_logprobs) == len(out_tokens)
        for j, entry in enumerate(out_logprobs):
            row = ref[len(prompt) - 1 + j]
            assert entry.token_id == out_tokens[j]
            assert entry.logprob == pytest.approx(row[out_tokens[j]].item(), abs=1e-4)
            assert [t for t, _ in entry.top] == row.topk(p.logprobs).indices.tolist()
