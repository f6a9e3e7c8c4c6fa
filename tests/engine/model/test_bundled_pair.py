"""The bundled Qwen2.5-Coder pair end to end: draft-model speculation on real weights is lossless.

float32 so that greedy equality is exact arithmetic, not luck with bfloat16 rounding.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

TARGET = "bundled:qwen2.5-coder-1.5b-instruct"
DRAFT = "bundled:qwen2.5-coder-0.5b-instruct"
PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    spec = SpeculativeConfig(
        method="draft", draft_model=DRAFT, num_speculative_tokens=4, adaptive=False
    )
    return LLMEngine(
        EngineConfig(
            model=TARGET, dtype="float32", kv_cache_gib=0.25, num_threads=2, speculative=spec
        )
    )


def test_bundled_pair_speculates_losslessly(engine: LLMEngine) -> None:
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    spec_params = SamplingParams(max_tokens=24, temperature=0.0)
    plain_params = SamplingParams(max_tokens=24, temperature=0.0, num_speculative_tokens=0)
    spec, plain = engine.generate([prompt, prompt], [spec_params, plain_params])
    assert spec.output_token_ids == plain.output_token_ids
    assert plain.spec.num_draft_tokens == 0
    assert spec.spec.num_draft_tokens > 0
    # The 0.5B coder drafts code for the 1.5B well: most drafts survive.
    assert spec.spec.acceptance_rate is not None and spec.spec.acceptance_rate > 0.5
    text = spec.detokenizer.text
    assert "return" in text or "fibonacci" in text or "if" in text
