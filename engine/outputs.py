"""Typed values the engine hands to its callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


class ContextLengthError(ValueError):
    """A request whose prompt plus max_tokens does not fit the context window."""

    def __init__(self, num_prompt: int, max_tokens: int, max_model_len: int) -> None:
        self.num_prompt, self.max_tokens, self.max_model_len = num_prompt, max_tokens, max_model_len
        super().__init__(
            f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is "
            f"{num_prompt + max_tokens}, beyond the context window of {max_model_len} tokens"
        )


# Who put a token in the output: the proposers' names ("draft", "ngram", "grammar") for accepted
# drafts, TARGET for the target's own sample (plain decoding, a recovered or a bonus token).
TARGET = "target"


@dataclass(frozen=True)
class TokenSpan:
    """One emitted token's share of an output's text, and who proposed it (`Sequence.origins`)."""

    text: str
    origin: str


@dataclass
class SpecStats:
    """Speculative accounting for one request (cumulative) or one step."""

    num_drafts: int = 0  # verify passes that carried at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # index = draft position
    # verify passes whose drafts reached each position (a tree's: depth), so the acceptance at
    # position i is accepted_per_pos[i] / drafted_per_pos[i]
    drafted_per_pos: list[int] = field(default_factory=list)
    num_emitted_tokens: int = 0
    # proposer -> [draft tokens, accepted tokens]
    by_proposer: dict[str, list[int]] = field(default_factory=dict)

    def add(
        self, num_draft: int, num_accepted: int, proposer: str = "", depth: int | None = None
    ) -> None:
        """One verify pass: `depth` is a tree's (its deepest node's), None for a chain (k)."""
        if num_draft == 0:
            return
        depth = num_draft if depth is None else depth
        _add_at(self.drafted_per_pos, [1] * depth)
        if proposer:
            counts = self.by_proposer.setdefault(proposer, [0, 0])
            counts[0] += num_draft
            counts[1] += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        for name, (drafted, accepted) in other.by_proposer.items():
            counts = self.by_proposer.setdefault(name, [0, 0])
            counts[0] += drafted
            counts[1] += accepted
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            pad = len(other.accepted_per_pos) - len(self.accepted_per_pos)
            self.accepted_per_pos.extend([0] * pad)
        for pos, n in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[pos] += n
        _add_at(self.drafted_per_pos, other.drafted_per_pos)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted per draft pass: tokens each verify pass yields (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def _add_at(counts: list[int], more: list[int]) -> None:
    """counts[i] += more[i], counts grown to fit."""
    counts.extend([0] * (len(more) - len(counts)))
    for i, n in enumerate(more):
        counts[i] += n


@dataclass
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @property
    def prefill_done(self) -> float | None:
        """The prompt is fully computed when the first token comes out."""
        return self.first_token


@dataclass
class RequestOutput:
    """What one engine step produced for one request: a delta, plus running totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    spec: SpecStats
    times: RequestTimes
    step_time: float  # monotonic time when this delta was produced
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first output only; first is None
    prompt_token_ids: list[int] | None = None  # first output only
    # One per new token, their texts adding up to new_text; only where params.token_origins
    new_token_spans: list[TokenSpan] | None = None


@dataclass
class StepStats:
    """What one engine step did, for the metrics exporter."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_prompt_tokens: int  # prompt tokens computed this step
    num_generation_tokens: int  # tokens emitted this step
    spec: SpecStats
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    # k each decoding request was given this step (its largest over proposers), for the histogram
    spec_k_chosen: list[int] = field(default_factory=list)
