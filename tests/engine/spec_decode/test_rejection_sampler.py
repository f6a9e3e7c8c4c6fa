"""Verification keeps the target's distribution (statistically) and greedy output exactly."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.spec_decode.rejection_sampler import verify, verify_stochastic

V = 8
K = 3
TRIALS = 400_000


def random_dists(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.5) -> Tensor:
    return torch.softmax(scale * torch.randn(*shape, V, generator=gen), dim=-1)


def total_variation(tokens: Tensor, expected: Tensor) -> float:
    observed = torch.bincount(tokens, minlength=expected.numel()).double() / tokens.numel()
    return 0.5 * float((observed - expected.double()).abs().sum())


def emitted_at(pos: int, drafts: Tensor, num_accepted: Tensor, final: Tensor) -> Tensor:
    """Tokens emitted at draft position pos, over the trials that reached it (a >= pos)."""
    reached = num_accepted >= pos
    from_draft = num_accepted[reached] > pos
    if pos == drafts.shape[1]:
        return final[reached]
    return torch.where(from_draft, drafts[reached, pos], final[reached])


def run_trials(one_hot: bool, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """TRIALS verifies of the same p (target) and q (draft); drafts sampled from q (or fixed)."""
    gen = torch.Generator().manual_seed(seed)
    p = random_dists((K + 1,), gen, scale=3.0 if one_hot else 1.5)  # [K+1, V]
    if one_hot:
        # n-gram drafts come from no distribution the verifier knows: mostly the target's
        # favourite (so later positions get reached), otherwise any token.
        drafts = torch.randint(0, V, (TRIALS, K), generator=gen)
        favourite = torch.rand(TRIALS, K, generator=gen) < 0.8
        drafts = torch.where(favourite, p[:K].argmax(dim=-1), drafts)
        q = None
    else:
        q = random_dists((K,), gen)  # [K, V]
        drafts = torch.multinomial(q, TRIALS, replacement=True, generator=gen).T  # [TRIALS, K]
        q = q.expand(TRIALS, -1, -1)
    num_accepted, final = verify_stochastic(p.expand(TRIALS, -1, -1), drafts, q, gen)
    return p, drafts, num_accepted, final


def test_every_position_matches_target_distribution() -> None:
    for one_hot in (False, True):
        p, drafts, num_accepted, final = run_trials(one_hot, seed=0 if not one_hot else 1)
        for pos in range(K + 1):
            tokens = emitted_at(pos, drafts, num_accepted, final)
            assert tokens.numel() > 40_000, (one_hot, pos, tokens.numel())
            tv = total_variation(tokens, p[pos])
            assert tv < 0.01, (one_hot, pos, tv)


def test_joint_of_first_two_tokens_with_context_dependent_target() -> None:
    """p1 depends on the first token; after a rejection at 0 the next step samples p1 plainly."""
    gen = torch.Generator().manual_seed(2)
    p0, q0 = random_dists((), gen), random_dists((), gen)  # [V]
    p1, q1 = random_dists((V,), gen), random_dists((V,), gen)  # [V, V]: row = first token
    x0 = torch.multinomial(q0, TRIALS, replacement=True, generator=gen)  # [TRIALS]
    x1 = torch.multinomial(q1[x0], 1, generator=gen).squeeze(1)
    target = torch.stack([p0.expand(TRIALS, -1), p1[x0], p1[x0]], dim=1)  # [TRIALS, 3, V]
    draft = torch.stack([q0.expand(TRIALS, -1), q1[x0]], dim=1)  # [TRIALS, 2, V]
    num_accepted, final = verify_stochastic(target, torch.stack([x0, x1], 1), draft, gen)
    first = torch.where(num_accepted > 0, x0, final)
    next_step = torch.multinomial(p1[first], 1, generator=gen).squeeze(1)
    second = torch.where(num_accepted > 1, x1, torch.where(num_accepted == 1, final, next_step))
    expected = (p0[:, None] * p1).flatten()  # [V*V]
    assert total_variation(first * V + second, expected) < 0.01


def test_draft_equal_to_target_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(3)
    p = random_dists((K + 1,), gen)
    drafts = torch.multinomial(p[:K], 20_000, replacement=True, generator=gen).T
    num_accepted, _ = verify_stochastic(
        p.expand(20_000, -1, -1), drafts, p[:K].expand(20_000, -1, -1), gen
    )
    assert bool((num_accepted == K).all())
    tokens = verify(p, drafts[0].tolist(), p[:K], greedy=False, generator=gen)
    assert tokens[:K] == drafts[0].tolist() and len(tokens) == K + 1


def test_public_verify_equals_batched_path_for_same_seed() -> None:
    gen = torch.Generator().manual_seed(4)
    for trial in range(200):
        k = trial % (K + 1)
        p, q = random_dists((k + 1,), gen), random_dists((k,), gen)
        drafts = torch.randint(0, V, (k,), generator=gen)
        for draft_probs in (q, None):
            got = verify(
                p, drafts.tolist(), draft_probs, False, torch.Generator().manual_seed(trial)
            )
            a, final = verify_stochastic(
                p[None],
                drafts[None],
                None if draft_probs is None else draft_probs[None],
                torch.Generator().manual_seed(trial),
            )
            assert got == drafts[: int(a)].tolist() + [int(final)]


def test_public_verify_first_token_distribution() -> None:
    gen = torch.Generator().manual_seed(5)
    p, q = random_dists((K + 1,), gen), random_dists((K,), gen)
    firsts = []
    for _ in range(8_000):
        drafts = torch.multinomial(q, 1, generator=gen).squeeze(1).tolist()
        firsts.append(verify(p, drafts, q, greedy=False, generator=gen)[0])
    assert total_variation(torch.tensor(firsts), p[0]) < 0.03


def _greedy_target(ids: list[int]) -> Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), V).float()  # [k+1, V]


def test_greedy_all_accepted_gives_bonus() -> None:
    target = _greedy_target([3, 1, 4, 5])
    assert verify(target, [3, 1, 4], None, greedy=True, generator=None) == [3, 1, 4, 5]


def test_greedy_mismatch_at_first_position() -> None:
    target = _greedy_target([3, 1, 4, 5])
    assert verify(target, [2, 1, 4], None, greedy=True, generator=None) == [3]


def test_greedy_mismatch_mid_run_ignores_later_matches() -> None:
    target = _greedy_target([3, 1, 4, 5])
    draft_probs = random_dists((3,), torch.Generator().manual_seed(6))
    assert verify(target, [3, 2, 4], draft_probs, greedy=True, generator=None) == [3, 1]


def test_greedy_uses_argmax_of_non_one_hot_target_and_k_zero() -> None:
    target = torch.tensor([[0.1, 0.6, 0.3, 0, 0, 0, 0, 0], [0.5, 0.2, 0.3, 0, 0, 0, 0, 0]])
    assert verify(target, [1], None, greedy=True, generator=None) == [1, 0]
    assert verify(target[:1], [], None, greedy=True, generator=None) == [1]


def test_stochastic_without_drafts_samples_target() -> None:
    gen = torch.Generator().manual_seed(7)
    p = random_dists((1,), gen)
    _, final = verify_stochastic(
        p.expand(100_000, -1, -1), torch.empty(100_000, 0, dtype=torch.long), None, gen
    )
    assert total_variation(final, p[0]) < 0.01
