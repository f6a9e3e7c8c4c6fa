"""Counter-based noise for seeded requests: the seed decides the text, nothing else does.

A seeded request's randomness at output position p of choice c is a function of (seed, c, p)
only: a 64-bit row key mixed on the host from the triple, then one 32-bit hash per (row key,
token id) computed with integer tensor ops, turned into an Exp(1) draw E. Sampling is the
Gumbel-max trick written as an exponential race: with g = -log E a standard Gumbel,

    argmax_t (log p[t] + g[t]) = argmax_t (p[t] / E[t])

is an exact sample from p. Whoever computes position p (plain decoding, the draft model, a verify
row, a recomputation after preemption) draws the same noise: the batch, the device's RNG state,
and how many positions a step computes never enter. So the target's token at every position is a
function of the text so far and the seed, and speculation can verify by matching.

Why a hash and not a torch.Generator per row: both cost about the same on a CPU at a 152k vocab
(docs/SAMPLING.md has the numbers), but the hash runs where the logits are (no host round trip on
a GPU), gives the same bits on every device, and needs no per-row Python loop.

The hash works on int32 tensors (int64 shifts and products are several times slower on a CPU);
the bits are checked against a pure-Python reference in the tests.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.model import device as devices

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
# Wellons' lowbias32 (hash prospector): shifts 16, 15, 16 around two odd multipliers.
_MUL_A = 0x7FEB352D
_MUL_B = 0x846CA68B
_TOKEN_STEP = 0x9E3779B9  # odd: spreads consecutive token ids before mixing
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1
# Rows keeping at most this many tokens race over their support alone (topk, then gather): a
# top-p nucleus almost always fits (engine.sample.sampler.NUCLEUS_CANDIDATES is the same bet),
# and a topk much wider than this costs more than hashing the whole vocabulary.
SPARSE_MAX_SUPPORT = 1024


@dataclass(frozen=True)
class SeedStream:
    """One choice's stream of per-position noise: n choices of a seeded request have n streams."""

    key: int  # 64-bit, mixed from (seed, choice)

    @staticmethod
    def of(seed: int, choice: int) -> SeedStream:
        return SeedStream(_splitmix64(_splitmix64(seed & _MASK64) ^ (choice & _MASK64)))

    def row_keys(self, first_position: int, count: int) -> list[int]:
        """The row keys of output positions first_position .. first_position + count - 1."""
        positions = range(first_position, first_position + count)
        return [_splitmix64(self.key ^ _splitmix64(p)) for p in positions]


def exponential_at(
    row_keys: list[int],  # [R] 64-bit row keys (SeedStream.row_keys)
    vocab_size: int,
    device: torch.device,
    token_ids: Tensor | None = None,  # [R, C] long: the tokens to draw for; None: all V
) -> Tensor:  # [R, C] float32 Exp(1) draws; token t's is a function of (row key, t) only
    h = counter_bits(row_keys, vocab_size, device, token_ids)  # [R, C]
    # v = (|h| + 1/2) / 2**31, uniform in (0, 1) on a grid of 2**-31 (h and -h share a point):
    # small |h| convert to float exactly, so v keeps full relative precision near 0, where
    # E = -log1p(-v) is small, i.e. where the race's winners are. Four passes, no bit shuffling.
    minus_v = h.float().abs_().add_(0.5).mul_(-(2.0**-31))  # [R, C]
    minus_v.clamp_(min=-_BELOW_ONE)  # v = 1 would give E = inf, losing even to a masked token
    return minus_v.log1p_().neg_()


def counter_bits(
    row_keys: list[int],  # [R]
    vocab_size: int,
    device: torch.device,
    token_ids: Tensor | None = None,  # [R, C] long; None: all V
) -> Tensor:  # [R, C] int32: 32 random bits per (row key, token)
    """lowbias32(lowbias32(t * STEP) ^ key_lo + key_hi): the token's hash does not depend on the
    row, so it is computed once per vocabulary; each row then costs one xor, one add, one mix."""
    keys = torch.tensor([_split(k) for k in row_keys], dtype=torch.int32, device=device)  # [R, 2]
    table = _token_hashes(vocab_size, torch.device(device))  # [V]
    h = (table[None, :] if token_ids is None else table[token_ids]) ^ keys[:, :1]  # [R, C]
    return _mix32(h.add_(keys[:, 1:]))


def gumbel_max(
    probs: Tensor,  # [R, V] processed probabilities (zeros where masked)
    row_keys: list[int],  # [R]
) -> Tensor:  # [R] long: argmax(log p + g) = argmax(p / E), exactly distributed as p
    """The race over each row's support only: a token of probability 0 can never win, and a
    top-k or top-p row often keeps a few dozen of 152k tokens, so most of the hashing is skipped."""
    vocab_size, device = probs.shape[1], probs.device
    # Sizing the support reads it on the host: worth it on a CPU, a stall on a GPU.
    sparse = devices.host_syncs_free(device) and probs.numel() > 0
    support = int((probs > 0).sum(dim=-1).max()) if sparse else 0
    if 0 < support <= min(SPARSE_MAX_SUPPORT, vocab_size // 2):
        values, ids = probs.topk(support, dim=-1)  # [R, C]
        noise = exponential_at(row_keys, vocab_size, device, ids)  # [R, C]
        return ids.gather(1, race(values, noise)[:, None]).squeeze(1)
    return race(probs, exponential_at(row_keys, vocab_size, device))


def race(
    probs: Tensor,  # [R, C]
    noise: Tensor,  # [R, C] Exp(1), used up
) -> Tensor:  # [R] long: argmax(probs / noise)
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # E = 0 would make a masked token's 0/0 = nan
    return torch.div(probs.float(), noise, out=noise).argmax(dim=-1)


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab_size: int, device: torch.device) -> Tensor:  # [V] int32, row-independent
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return _mix32(_to_int32((tokens * _TOKEN_STEP) & _MASK32))


def _mix32(h: Tensor) -> Tensor:  # [...] int32 bits -> the same, avalanched (in place)
    """lowbias32 on int32 tensors: products wrap mod 2**32 (tests/engine/sample/test_seeded.py checks the bits
    against Python integers), and right shifts are made logical by masking. One scratch tensor
    serves every shift: a [R, 152k] temporary per op costs more in page faults than in work."""
    scratch = torch.empty_like(h)
    for shift, multiplier in ((16, _MUL_A), (15, _MUL_B), (16, None)):
        torch.bitwise_right_shift(h, shift, out=scratch)
        h.bitwise_xor_(scratch.bitwise_and_((1 << (32 - shift)) - 1))  # logical shift
        if multiplier is not None:
            h.mul_(_signed(multiplier))
    return h


def _to_int32(x: Tensor) -> Tensor:  # int64 holding 32-bit values -> int32 with the same bits
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def _signed(x: int) -> int:
    return x - (1 << 32) if x >= 1 << 31 else x


def _split(key: int) -> tuple[int, int]:
    return _signed(key & _MASK32), _signed((key >> 32) & _MASK32)


def _splitmix64(x: int) -> int:
    """Steele, Lea and Flood's SplitMix64 finalizer on Python ints (host side, exact)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
