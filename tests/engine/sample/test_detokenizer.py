"""Incremental detokenization equals a full decode; stop strings cut exactly; nothing taken back."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tiny import _CORPUS, build_tiny_tokenizer
from tokenizers import Tokenizer, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.sample.detokenizer import IncrementalDetokenizer

# Characters the tiny tokenizer saw (merged tokens) and never saw (split into byte tokens).
PIECES = [
    "the",
    " quick",
    " dog",
    "Hello",
    ",",
    " ",
    " ",
    "\n",
    "é",
    "ï",
    "日本語",
    "😀",
    "🚀",
    "Straße",
    "ж",
    "€",
    "🦀",
    "ü",
    "中文",
    "한국어",
    "def",
    "(",
    ")",
    "  ",
    "1",
    "42",
]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def sentencepiece_like() -> Any:
    """Llama-2 style: '▁' space markers, byte fallback, and a decoder that strips one leading
    space, so a token's text depends on whether it starts the decoded sequence."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


def random_text(rng: random.Random, num_pieces: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(num_pieces))


def encode(tokenizer: Any, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def decode(tokenizer: Any, ids: list[int], skip: bool = True) -> str:
    text: str = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    return text


def stream(
    tokenizer: Any,
    prompt: list[int],
    output: list[int],
    stop: tuple[str, ...] = (),
    skip: bool = True,
) -> tuple[IncrementalDetokenizer, list[str], str | None]:
    """Feed output token by token like the engine: append, then pop a delta; finish at the end."""
    detok = IncrementalDetokenizer(tokenizer, prompt, stop, skip)
    deltas: list[str] = []
    hit = None
    for token in output:
        hit = detok.append(token)
        if hit is not None:
            break
        deltas.append(detok.pop_delta(finished=False))
        assert "".join(deltas) == detok.text[: len("".join(deltas))]  # never taken back
    deltas.append(detok.pop_delta(finished=True))
    return detok, deltas, hit


def test_byte_level_text_equals_full_decode_without_partial_chars(byte_level: Any) -> None:
    rng = random.Random(0)
    for _ in range(60):
        prompt = encode(byte_level, random_text(rng, rng.randint(1, 6)))
        output = encode(byte_level, random_text(rng, rng.randint(1, 30)))
        detok, deltas, _ = stream(byte_level, prompt, output)
        assert detok.text == "".join(deltas) == decode(byte_level, output)
        assert not any("\ufffd" in d for d in deltas)


def test_multi_byte_char_split_across_tokens_waits_for_last_byte(byte_level: Any) -> None:
    output = encode(byte_level, "a🦀b")
    assert len(output) >= 4  # the crab was never seen: one token per byte
    detok = IncrementalDetokenizer(byte_level, encode(byte_level, "x"), (), True)
    seen = []
    for token in output:
        detok.append(token)
        seen.append(detok.pop_delta(finished=False))
    assert seen[0] == "a" and "".join(seen) == "a🦀b"
    assert all(d == "" for d in seen[1:-2]) and seen[-2] == "🦀"


def test_text_is_a_prefix_of_the_full_decode_at_every_step(byte_level: Any) -> None:
    rng = random.Random(1)
    output = encode(byte_level, random_text(rng, 40))
    detok = IncrementalDetokenizer(byte_level, encode(byte_level, "hi"), (), True)
    for i, token in enumerate(output):
        detok.append(token)
        full = decode(byte_level, output[: i + 1])
        assert full.startswith(detok.text)
        waiting = full[len(detok.text) :]
        assert waiting == "" or waiting.endswith("\ufffd")  # only an incomplete char waits


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_match_full_decode(byte_level: Any, skip: bool) -> None:
    """Arbitrary ids (special tokens, stray continuation bytes): the finished text still equals
    the full decode, invalid bytes included."""
    rng = random.Random(2)
    for _ in range(40):
        prompt = encode(byte_level, random_text(rng, 3))
        output = [rng.randrange(len(byte_level)) for _ in range(rng.randint(1, 25))]
        detok, deltas, _ = stream(byte_level, prompt, output, skip=skip)
        assert detok.text == "".join(deltas) == decode(byte_level, output, skip)


def test_leading_space_markers_use_prompt_context(sentencepiece_like: Any) -> None:
    tok = sentencepiece_like
    prompt_text = "The quick brown fox"
    rng = random.Random(3)
    for _ in range(40):
        output_text = random_text(rng, rng.randint(1, 20))
        prompt = encode(tok, prompt_text)
        output = encode(tok, output_text)  # starts with a space marker
        both = prompt + output
        detok, deltas, _ = stream(tok, prompt, output)
        expected = decode(tok, both)[len(decode(tok, prompt)) :]
        assert detok.text == "".join(deltas) == expected
        assert not any("\ufffd" in d for d in deltas)
    detok, _, _ = stream(tok, encode(tok, "The"), encode(tok, "dog"))
    assert decode(tok, encode(tok, "dog")) == "dog"  # decoded alone, it loses its space
    assert detok.text == " dog"


def test_stop_string_spanning_tokens_cuts_text_exactly(byte_level: Any) -> None:
    output = encode(byte_level, "Hello, world! How are you today?")
    detok, deltas, hit = stream(byte_level, encode(byte_level, "Q:"), output, stop=("o, wor",))
    assert hit == "o, wor"
    assert detok.text == "".join(deltas) == "Hell"


def test_earliest_of_several_stop_strings_wins(byte_level: Any) -> None:
    output = encode(byte_level, "naïve café 日本語 😀 résumé")
    detok, deltas, hit = stream(byte_level, [1], output, stop=("résumé", "日本", "😀"))
    assert hit == "日本"
    assert detok.text == "".join(deltas) == "naïve café "


def test_random_stop_strings_against_reference(byte_level: Any) -> None:
    rng = random.Random(4)
    for _ in range(60):
        text = random_text(rng, 25)
        start = rng.randrange(len(text) - 3)
        stops = (text[start : start + rng.randint(1, 6)], "never-there")
        detok, deltas, hit = stream(byte_level, [5], encode(byte_level, text), stop=stops)
        assert hit == stops[0]
        assert detok.text == "".join(deltas) == text[: text.find(stops[0])]


def test_possible_stop_prefix_is_held_back_then_released(byte_level: Any) -> None:
    detok = IncrementalDetokenizer(byte_level, [5], ("STOP",), True)
    for token in encode(byte_level, "abc ST"):
        assert detok.append(token) is None
    assert detok.pop_delta(finished=False) == "abc "
    for token in encode(byte_level, "O"):
        assert detok.append(token) is None
    assert detok.pop_delta(finished=False) == ""
    assert detok.text == "abc STO"
    assert detok.pop_delta(finished=True) == "STO"


def test_false_start_is_released_once_it_cannot_be_a_stop(byte_level: Any) -> None:
    detok = IncrementalDetokenizer(byte_level, [5], ("STOP",), True)
    for token in encode(byte_level, "xST"):
        detok.append(token)
    assert detok.pop_delta(finished=False) == "x"
    for token in encode(byte_level, "ay"):
        detok.append(token)
    assert detok.pop_delta(finished=False) == "STay"


def test_unfinished_character_is_flushed_when_finished(byte_level: Any) -> None:
    crab = encode(byte_level, "🦀")
    output = encode(byte_level, "ok") + crab[:2]
    detok, deltas, _ = stream(byte_level, [5], output)
    assert deltas[-1].endswith("\ufffd")  # the request ended mid-character: say so, once
    assert detok.text == "".join(deltas) == decode(byte_level, output)


def test_tiny_tokenizer_module_is_the_one_under_test(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer(tmp_path)
    assert tok.decode(tok.encode("日本語 😀")) == "日本語 😀"
