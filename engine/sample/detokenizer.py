"""Incremental detokenization with stop strings.

Each new token is decoded inside a small window of token ids: the *prefix* (tokens whose text
was already emitted, kept as context) and the *read* part (tokens not yet turned into text).
The new text is decode(prefix + read) minus decode(prefix). Context matters for tokenizers
whose tokens carry a leading-space marker (decode strips it from the first token) and for
byte-level BPE, where one character can span several tokens: while the window's text ends in
U+FFFD the character is incomplete, so nothing is emitted until the next token completes it.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as decoding context for the first output token (vLLM uses 5 as well).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,  # PreTrainedTokenizerBase
        prompt_token_ids: list[int],
        stop: tuple[str, ...],
        skip_special_tokens: bool,
        track_tokens: bool = False,  # keep where each token's text ends (for `token_texts`)
        kept_special_ids: tuple[int, ...] = (),  # special tokens whose text is kept anyway
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped = _skipped_ids(tokenizer, kept_special_ids) if kept_special_ids else None
        self._stop = tuple(s for s in stop if s)
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT:])  # ids around the read point
        self._prefix_offset = 0  # window[prefix_offset:read_offset]: context already emitted
        self._read_offset = len(self._window)  # window[read_offset:]: not yet text
        self._text = ""
        self._num_sent = 0  # characters of text already handed out by pop_delta
        self.stop_reason: str | None = None
        # len(text) after each token: where its text ends; None unless tracked
        self.token_ends: list[int] | None = [] if track_tokens else None

    @property
    def text(self) -> str:
        """Full output text so far; once a stop string is hit, the text before it."""
        return self._text

    def append(self, token_id: int) -> str | None:
        """Feed one token; returns the stop string if the text now contains one."""
        if self.stop_reason is None:
            self._window.append(token_id)
            delta = self._decode_new_text(final=False)
            if delta:
                old_len = len(self._text)
                self._text += delta
                self._check_stop(old_len)
        if self.token_ends is not None:
            self.token_ends.append(len(self._text))
        return self.stop_reason

    @property
    def num_sent(self) -> int:
        """Characters of text handed out so far: where the next pop_delta starts."""
        return self._num_sent

    def pop_delta(self, finished: bool) -> str:
        """Text not handed out yet; unless finished, hold back what may start a stop string."""
        if finished and self.stop_reason is None:
            self._text += self._decode_new_text(final=True)
        end = len(self._text)
        if not finished and self.stop_reason is None:
            end = max(self._num_sent, end - self._possible_stop_prefix_len())
        delta = self._text[self._num_sent : end]
        self._num_sent = end
        return delta

    def token_texts(self, start: int, text: str, first_token: int) -> list[str]:
        """`text`, the characters from `start` that pop_delta handed out, cut where each token from
        `first_token` on ends: one piece per token, adding up to `text`. Characters before the first
        cut (released from an earlier token by a stop-string hold) go with the first piece, and a
        final flush with the last; a token that completed no character gets "" """
        assert self.token_ends is not None, "built without track_tokens"
        ends = self.token_ends[first_token:]
        if not ends:
            return [text] if text else []
        stop, cut, pieces = start + len(text), start, []
        for end in ends[:-1]:
            end = min(max(end, cut), stop)
            pieces.append(text[cut - start : end - start])
            cut = end
        pieces.append(text[cut - start :])
        return pieces

    def _decode_new_text(self, final: bool) -> str:
        """Text of the unread tokens, or "" while it ends in an incomplete character."""
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self._decode(self._window[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._window[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(_REPLACEMENT) and not final:
            return ""
        self._advance()
        return full_text[len(prefix_text) :]

    def _advance(self) -> None:
        """Everything read so far becomes context; drop the context before it."""
        del self._window[: self._prefix_offset]
        self._prefix_offset = self._read_offset - self._prefix_offset
        self._read_offset = len(self._window)

    def _decode(self, token_ids: list[int]) -> str:
        skip = self._skip_special_tokens
        if skip and self._skipped is not None:  # skip all special tokens but the kept ones
            token_ids, skip = [t for t in token_ids if t not in self._skipped], False
        text: str = self._tokenizer.decode(
            token_ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
        return text

    def _check_stop(self, old_len: int) -> None:
        """Find the earliest stop string that ends in the new text; cut the text before it."""
        hits = []
        for stop in self._stop:
            index = self._text.find(stop, max(0, old_len - len(stop) + 1))
            if index >= 0:
                hits.append((index, stop))
        if hits:
            index, self.stop_reason = min(hits)
            self._text = self._text[:index]

    def _possible_stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


def _skipped_ids(tokenizer: Any, kept: tuple[int, ...]) -> frozenset[int]:
    """The special tokens decoding skips, less the kept ones."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, token in added.items() if getattr(token, "special", False)}
    return frozenset((special | set(tokenizer.all_special_ids)) - set(kept))
