"""Shared fixtures: tiny random models built once per test session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny import make_tiny_model  # noqa: E402

# The CPU is shared; one thread keeps tiny-model tests cheap and deterministic.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer qwen2-family model (seed 0) with the tiny tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), family="qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer draft of the same family and tokenizer, different weights (seed 1)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_draft"), family="qwen2", seed=1, num_layers=1
    )


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A module's own SPECSERVE_CACHE, for the files its loads convert."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def vocab(tiny_model_dir: Path) -> int:
    """The tiny target's vocabulary size."""
    from engine_utils import hf_model

    return int(hf_model(tiny_model_dir).config.vocab_size)


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> object:  # engine.core.llm_engine.LLMEngine
    """The tiny target decoding plainly: the reference speculative engines must equal."""
    from engine_utils import make_engine

    return make_engine(tiny_model_dir)
