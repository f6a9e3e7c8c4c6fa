"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sample.structured import Constraints


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    # Which of a request's n choices this is: with a seed, each choice samples its own stream.
    choice: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives for each sampled token (0: only the token)
    prompt_logprobs: int | None = None  # same for prompt tokens (echo)
    skip_special_tokens: bool = True
    # Special tokens whose text stays though special tokens are skipped (a tool-call format's
    # markers, such as Mistral's [TOOL_CALLS], which the server's parser must see).
    kept_special_ids: tuple[int, ...] = ()
    num_speculative_tokens: int | None = None  # None: the server's k; 0: no speculation
    token_origins: bool = False  # each output carries its tokens' texts and origins (TokenSpan)
    # logit_bias and grammar (engine/sample/structured.py); None: unconstrained
    constraints: Constraints | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 or positive")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
