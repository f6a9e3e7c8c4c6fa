"""Logits processing that stays exact under speculation: logit_bias and grammars (llguidance).

A request's `SamplingParams.constraints` says what to enforce; its `Sequence.constraint` holds the
one grammar matcher, advanced only by emitted tokens. Every row the engine samples from (the
draft's proposals, each of the k + 1 verify rows) is constrained by the mask of the matcher *after
the drafts before that row*: the matcher consumes them, fills the mask and rolls them back. So the
draft's q and the target's p are the same masked distributions that plain decoding would use at
that position, and rejection sampling keeps the output distribution exact. Rows after a draft the
grammar refuses are never reached (that draft has p = 0 and is rejected); they get the last valid
row's mask so that no row is ever empty.

Masks are plain int32 bitmasks `[rows, ceil(vocab / 32)]` (bit t of word t // 32 allows token t),
the format llguidance fills and any other grammar backend could. Tokens the tokenizer does not
have (the model's vocabulary padding) are always masked.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch
from torch import Tensor

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

# Compact JSON as `json.dumps` writes it: no free whitespace, so output length stays bounded.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_BIAS = 100.0
FORCED_SOURCE = "grammar"  # the proposer name of grammar-forced drafts (metrics, SpecStats, k)
log = logging.getLogger("specserve.engine")

# llama.cpp names the rows that pad a GGUF vocabulary `[PAD<id>]`; converted, they look like text.
_PADDING = re.compile(r"\[PAD\d+\]")

_tokenizers: dict[int, tuple[object, llguidance.LLTokenizer, int]] = {}
_tokenizers_lock = threading.Lock()


@dataclass(frozen=True)
class Constraints:
    """What a request constrains; `grammar` is an llguidance grammar (see `grammar_from`)."""

    grammar: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])


@dataclass
class ConstraintState:
    """One request's live constraint: its matcher (None without a grammar) and its bias."""

    constraints: Constraints
    matcher: llguidance.LLMatcher | None
    vocab_size: int  # real tokens: rows at and beyond it are vocabulary padding, always masked
    matcher_vocab: int  # the grammar tokenizer's size (the bitmask's width in bits, rounded up)
    bias_ids: Tensor = field(init=False)  # [num_biased] long
    bias_values: Tensor = field(init=False)  # [num_biased] float32

    def __post_init__(self) -> None:
        pairs = self.constraints.logit_bias
        self.bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in pairs], dtype=torch.float32)

    @property
    def is_done(self) -> bool:
        """The grammar takes nothing more (complete, or broken: never sample from an empty mask)."""
        return self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error())


# ---------------------------------------------------------------------------- grammars


def grammar_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of a HF tokenizer: built once per tokenizer (seconds for 150k tokens),
    so callers on an event loop should first call it in a thread."""
    return _tokenizer_info(tokenizer)[1]


def warm_up(tokenizer: Any) -> None:
    """Build the tokenizer's grammar view now (call in a thread at startup), so that neither the
    event loop nor the engine's step loop ever waits for it."""
    try:
        _tokenizer_info(tokenizer)
    except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot take: requests say so
        log.warning("grammar support unavailable for this tokenizer: %s", exc)


def real_vocab_size(tokenizer: Any) -> int:
    """Token ids below it are real tokens; at and above it, vocabulary padding."""
    return _tokenizer_info(tokenizer)[2]


def _tokenizer_info(tokenizer: Any) -> tuple[object, llguidance.LLTokenizer, int]:
    key = id(tokenizer)
    with _tokenizers_lock:
        if key not in _tokenizers:
            ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
            size = min(len(tokenizer), ll_tokenizer.vocab_size)
            tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
            while size > 0 and _PADDING.fullmatch(str(tokens[size - 1])):
                size -= 1
            _tokenizers[key] = (tokenizer, ll_tokenizer, size)
        return _tokenizers[key]


def grammar_from(kind: str, spec: Any) -> str:
    """An llguidance grammar from a JSON schema (dict or string), a regex, a list of choices or a
    Lark/GBNF grammar. Raises ValueError for a spec that is not even of the right shape."""
    if kind == "json":
        schema = spec if isinstance(spec, str) else json.dumps(spec)
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec))
    if kind == "choice":
        return str(llguidance.LLMatcher.grammar_from_lark(choice_lark(spec)))
    if kind == "lark":
        return str(llguidance.LLMatcher.grammar_from_lark(spec))
    if kind == "grammar":
        return str(llguidance.grammar_from("grammar", spec))
    raise ValueError(f"unknown grammar kind {kind!r}")


def choice_lark(choices: list[str]) -> str:
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def check_grammar(grammar: str, tokenizer: Any) -> None:
    """Raise ValueError with llguidance's message if the grammar does not compile."""
    error = llguidance.LLMatcher.validate_grammar(grammar, grammar_tokenizer(tokenizer))
    if error:
        raise ValueError(error.strip())


def new_state(constraints: Constraints | None, tokenizer: Any) -> ConstraintState | None:
    """The state for a new request (hook: `Sequence.constraint` in `LLMEngine.add_request`)."""
    if constraints is None:
        return None
    _, ll_tokenizer, vocab_size = _tokenizer_info(tokenizer)
    matcher = None
    if constraints.grammar is not None:
        matcher = llguidance.LLMatcher(ll_tokenizer, constraints.grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid grammar: {matcher.get_error()}")
    return ConstraintState(constraints, matcher, vocab_size, ll_tokenizer.vocab_size)


# ---------------------------------------------------------------------------- the hooks


def constrain_rows(
    state: ConstraintState | None,
    logits: Tensor,  # [n, V] raw logits: row i follows seq's tokens plus draft_ids[:i]
    draft_ids: list[int],  # at least n - 1 drafts
) -> Tensor:  # [n, V] biased and masked (a new tensor; `logits` is untouched)
    """Verify rows (k drafts + bonus) or a draft model's row: bias, then the grammar's masks."""
    if state is None:
        return logits
    logits = logits.float().clone()
    if state.bias_ids.numel():
        logits[:, state.bias_ids.to(logits.device)] += state.bias_values.to(logits.device)
    if state.matcher is None or state.matcher.is_error():
        logits[:, state.vocab_size :] = -float("inf")
        return logits
    bitmask = fill_bitmasks(state.matcher, draft_ids, logits.shape[0], state.matcher_vocab)
    return apply_bitmask(logits, bitmask, state.vocab_size)


def constrain_verify_rows(
    states: list[ConstraintState | None],  # [batch] each request's constraint
    logits: Tensor,  # [num_tokens, V] raw target logits: len(drafts[b]) + 1 rows per request
    drafts: list[list[int]],  # [batch] each request's drafts
) -> Tensor:  # [num_tokens, V]; `logits` itself when no request is constrained
    """A step's verify rows (k drafts + bonus per request), each request's constrained as
    `constrain_rows` does. Hook: in `LLMEngine._verify`, on what goes to `verify_batch`."""
    if all(state is None for state in states):
        return logits
    out = logits.float().clone()
    first = 0
    for state, drafted in zip(states, drafts, strict=True):
        rows = slice(first, first + len(drafted) + 1)
        if state is not None:
            out[rows] = constrain_rows(state, out[rows], drafted)
        first = rows.stop
    return out


def constrain_draft_logits(
    states: list[ConstraintState | None],  # [B] each sequence's constraint
    logits: Tensor,  # [B, V_draft] one row per sequence, after its drafts so far
    drafts: list[list[int]],  # per sequence, the drafts it proposed before this row
) -> Tensor:  # [B, V_draft]
    """The draft model's row for each request, constrained as the verify row there will be."""
    if all(state is None for state in states):
        return logits
    rows = [
        constrain_rows(state, logits[i : i + 1].float(), drafted)
        for i, (state, drafted) in enumerate(zip(states, drafts, strict=True))
    ]
    return torch.cat(rows)


def cut_drafts(state: ConstraintState | None, draft_ids: list[int]) -> list[int]:
    """Drafts up to (not including) the first one the grammar refuses (n-gram proposals)."""
    matcher = state.matcher if state is not None else None
    if matcher is None or not draft_ids:
        return draft_ids
    return draft_ids[: matcher.validate_tokens(draft_ids)]


def advance(state: ConstraintState | None, token: int) -> bool:
    """Feed one emitted token to the matcher; True when the grammar is complete (finish the
    request). Hook: once per appended token, in `LLMEngine._stop`."""
    if state is None or state.matcher is None:
        return False
    state.matcher.consume_token(token)
    return state.is_done


def forced_tokens(state: ConstraintState | None, k: int) -> list[int]:
    """Up to k tokens the grammar forces from here (one legal continuation): free drafts."""
    if state is None or state.matcher is None or state.is_done or k <= 0:
        return []
    return list(state.matcher.compute_ff_tokens()[:k])


# ---------------------------------------------------------------------------- bitmasks


def fill_bitmasks(
    matcher: llguidance.LLMatcher, draft_ids: list[int], num_rows: int, matcher_vocab: int
) -> Tensor:  # [num_rows, ceil(matcher_vocab / 32)] int32
    """Row i: the mask after draft_ids[:i]. The matcher ends where it started."""
    bitmask = torch.zeros((num_rows, (matcher_vocab + 31) // 32), dtype=torch.int32)
    consumed, legal = 0, True
    for i in range(num_rows):
        if i > 0 and legal:
            legal = _consume(matcher, draft_ids[i - 1])
            consumed += int(legal)
        if legal:
            row = bitmask[i]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        else:  # past a refused draft: never reached, but no row may be empty
            bitmask[i] = bitmask[i - 1]
    if consumed:
        matcher.rollback(consumed)
    return bitmask


def _consume(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Consume if legal (an illegal token would put the matcher in an error state for good)."""
    if matcher.is_stopped() or matcher.validate_tokens([token]) != 1:
        return False
    return bool(matcher.consume_token(token))


def apply_bitmask(
    logits: Tensor,  # [n, V]
    bitmask: Tensor,  # [n, words] int32
    vocab_size: int,  # tokens at or past it (vocabulary padding) are always masked
) -> Tensor:  # [n, V]
    """-inf wherever the bitmask's bit is clear."""
    allowed = allowed_tokens(bitmask, logits.shape[1], vocab_size).to(logits.device)
    return logits.masked_fill(~allowed, -float("inf"))


def allowed_tokens(bitmask: Tensor, width: int, vocab_size: int) -> Tensor:  # [n, width] bool
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [n, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()[:, : min(width, vocab_size)]
    if allowed.shape[1] < width:
        allowed = torch.nn.functional.pad(allowed, (0, width - allowed.shape[1]), value=False)
    return allowed
