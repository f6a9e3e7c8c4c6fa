"""One request's tokens and progress through the engine, and what the scheduler hands the other
layers for a step (`ScheduledSeq`, `SchedulerOutput`, and back `SeqResult`). Only the scheduler
changes a `Sequence`'s tokens, progress and status (`Scheduler.update_from_output`); the engine only
drains what is pending for the caller.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.model.state_pool import StateRestore
from engine.outputs import TARGET, RequestTimes, SpecStats, TokenLogprob, TokenSpan
from engine.sample.detokenizer import IncrementalDetokenizer
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import SeedStream
from engine.sample.structured import ConstraintState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    times: RequestTimes
    detokenizer: IncrementalDetokenizer
    # A seeded request's per-position noise (engine/sample/seeded.py); None: unseeded.
    seed_stream: SeedStream | None
    num_speculative_tokens: int  # this request's k (0: plain decoding)
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V sit in the target's (and the draft's) cache. Rejected drafts are never counted,
    # so rolling back is simply not advancing these.
    num_computed_tokens: int = 0
    num_draft_computed_tokens: int = 0  # the draft model's or a head's K/V frontier
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of registered full blocks
    num_draft_cached_blocks: int = 0  # leading blocks flagged as holding the draft's K/V
    # A hybrid target's slot for its linear layers' recurrent state (engine/model/state_pool.py),
    # held while running; None: not running, or a model without such state
    state_slot: int | None = None
    # and, with prefix caching, the positions where its prefill snapshots that state (set on
    # admission, engine/core/state_cache.py)
    state_snapshot_at: tuple[int, ...] = ()
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    # Not yet handed to the caller:
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Who proposed each output token (engine.outputs.TARGET or a proposer's name); kept only where
    # params.token_origins asks
    origins: list[str] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_done: bool = False
    first_output_sent: bool = False
    # The grammar matcher and logit_bias (engine/sample/structured.py), advanced by emitted tokens only
    constraint: ConstraintState | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def reset_progress(self) -> None:
        """Nothing computed: before admission, or after preemption (recomputed from scratch)."""
        self.num_computed_tokens = self.num_draft_computed_tokens = 0
        self.block_hashes = []
        self.num_draft_cached_blocks = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def seeded_row_keys(self, count: int, ahead: int = 0) -> list[int] | None:
        """The noise keys of `count` output positions from `ahead` past the next one; None when
        unseeded or greedy. Positions count output tokens, so preemption never shifts them."""
        if self.seed_stream is None or self.params.greedy:
            return None
        return self.seed_stream.row_keys(self.num_output_tokens + ahead, count)

    def pending_spans(self, text_start: int, text: str) -> list[TokenSpan]:
        """The pending tokens' shares of `text` (what the detokenizer handed out from
        `text_start`) with their origins; text released with no new token goes as the last's."""
        first = self.num_output_tokens - len(self.pending_token_ids)
        pieces = self.detokenizer.token_texts(text_start, text, first)
        if not pieces:
            return []
        origins = self.origins[first:] or self.origins[-1:] or [TARGET]
        return [TokenSpan(piece, origin) for piece, origin in zip(pieces, origins, strict=True)]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_done


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # known tokens to compute: seq.token_ids[num_computed : num_computed + n]
    num_spec_tokens: int  # draft slots reserved after them (0 unless the chunk reaches the end)
    spec_k: dict[str, int] = field(default_factory=dict)  # proposer -> drafts it may propose

    def k_for(self, proposer: str) -> int:
        return min(self.spec_k.get(proposer, 0), self.num_spec_tokens)

    @property
    def reaches_end(self) -> bool:
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        """How many of this step's known tokens are prompt tokens (the rest recompute outputs)."""
        remaining = self.seq.num_prompt_tokens - self.seq.num_computed_tokens
        return max(0, min(remaining, self.num_new_tokens))


@dataclass(frozen=True)
class SeqResult:
    """What one step computed for one scheduled request: the engine's word to the scheduler,
    which alone changes the request (`Scheduler.update_from_output`)."""

    # accepted drafts, then the target's own (recovered or bonus) token; [] for a prompt chunk
    tokens: list[int] = field(default_factory=list)
    num_drafts: int = 0  # drafts the target verified
    proposer: str = ""  # who drafted them
    num_draft_computed: int | None = None  # the draft model's or head's K/V frontier (Proposal's)
    logprobs: list[TokenLogprob] | None = None  # one per token where asked
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # this chunk's, where asked

    @property
    def num_accepted(self) -> int:
        return max(0, len(self.tokens) - 1)

    def origin(self, i: int) -> str:
        """Who proposed the i-th token: the drafter for an accepted draft, else the target."""
        return self.proposer if i < self.num_accepted else TARGET


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_preempted: int
    # a hybrid target's newly admitted requests resuming from a prefix's state snapshot
    state_restores: list[StateRestore] = field(default_factory=list)
