"""Gemma 4's assistant draft (`speculative_method: gemma4-assistant`): a tiny random Gemma 4
target and tiny random gemma4_assistant checkpoints built with transformers 5.24.

The drafts against transformers' own SinglePositionMultiTokenCandidateGenerator given the same
target state (the target's forward over the context, its normed last hidden state and the K/V
of its last sliding and last full-attention layer), prompts past the window; then the lossless
checks: greedy output equal to plain decoding batched, with requests joining mid-batch, chunked
prefill and the prefix cache; seeded sampling the same with the draft on and off; a sampled
pair's law the target's (chi-square); and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_utils import chi_square_pvalue, greedy, hf_model, make_engine, outputs, random_prompts
from test_gemma4 import GEMMA4, SMALL, _tiny_gemma4
from test_qwen3_5_engine import NUM_SAMPLES, TEMPERATURE
from test_qwen3_5_engine import _exact_pair_probs as exact_pair_probs
from tiny import make_tiny_model
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from engine.config import SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sample.sampling_params import SamplingParams
from engine.sequence import ScheduledSeq
from engine.spec_decode.proposers.base import Proposal
from engine.spec_decode.proposers.gemma4_assistant import Gemma4AssistantProposer

LOCAL, FULL = "sliding_attention", "full_attention"
MAX_TOKENS = 12
K = 4
VOCAB = 400  # the tiny tokenizer's


def _write_assistant(path: Path, seed: int, **options: object) -> Path:
    """A 3-layer assistant (local, local, full) of width 32 for the 64-wide target, its norms,
    layer scalars and (ordered head) token ordering random, saved by transformers."""
    target = GEMMA4
    text = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=target["global_head_dim"],
        num_global_key_value_heads=target["num_global_key_value_heads"],
        attention_k_eq_v=target["attention_k_eq_v"],  # the full layers' KV heads follow it
        layer_types=[LOCAL, LOCAL, FULL], sliding_window=target["sliding_window"],
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, initializer_range=0.2,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )  # fmt: skip
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, **options)
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            if name.endswith("layer_scalar"):
                param.fill_(0.5 + torch.rand(1, generator=gen).item())
        if model.masked_embedding is not None:
            model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=gen))
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_gemma4(tmp_path_factory.mktemp("gemma4-target"), seed=0)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """E2B/E4B's shape: per-layer embeddings, the last two of six layers KV-shared (the assistant
    reads layers 3 and 2, the last of each type that computes K/V)."""
    return _tiny_gemma4(tmp_path_factory.mktemp("gemma4-small"), seed=2, **SMALL)


@pytest.fixture(scope="module")
def assistant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_assistant(tmp_path_factory.mktemp("gemma4-assistant"), seed=3)


@pytest.fixture(scope="module")
def ordered_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`use_ordered_embeddings`: 8 centroids of 50 tokens, the top 2 scored."""
    return _write_assistant(
        tmp_path_factory.mktemp("gemma4-ordered"), seed=4, use_ordered_embeddings=True,
        num_centroids=8, centroid_intermediate_top_k=2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def plain(target_dir: Path) -> LLMEngine:
    return make_engine(target_dir)


def _spec(path: Path, k: int = K, adaptive: bool = False) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="gemma4-assistant", num_speculative_tokens=k, draft_model=str(path),
        adaptive=adaptive,
    )  # fmt: skip


def _proposer(engine: LLMEngine) -> Gemma4AssistantProposer:
    proposer = engine._eagle3
    assert isinstance(proposer, Gemma4AssistantProposer)
    return proposer


def _drafted(seqs: list) -> int:  # type: ignore[type-arg]
    return sum(s.spec.num_draft_tokens for s in seqs)


# ---- the drafts against transformers' candidate generator -------------------------------------


@torch.no_grad()
def _hf_candidates(
    target_dir: Path, assistant_dir: Path, context: list[int], last: int
) -> tuple[list[int], torch.Tensor]:  # K drafts, their logits [K, vocab]
    """transformers' generator after the target's forward over `context` (positions [0, P)),
    drafting behind `last` (position P), as `generate` drives it after the prompt's forward."""
    target = hf_model(target_dir)
    assistant = Gemma4AssistantForCausalLM.from_pretrained(str(assistant_dir), dtype=torch.float32)
    assistant.generation_config.num_assistant_tokens = K
    target.generation_config.max_length = 4096
    out = target(
        torch.tensor([context]), output_hidden_states=True, return_shared_kv_states=True,
        use_cache=False,
    )  # fmt: skip
    generator = SinglePositionMultiTokenCandidateGenerator(
        assistant.eval(), target.get_input_embeddings(), target.generation_config
    )
    ids = torch.tensor([context + [last]])
    candidates, logits = generator.get_candidates(
        ids, {"attention_mask": torch.ones_like(ids)}, out, False, 0
    )
    return candidates[0, len(context) + 1 :].tolist(), logits[0].float()


def _record(proposer: Gemma4AssistantProposer) -> tuple[list[list[Proposal]], list[torch.Tensor]]:
    """Record the proposer's proposals and each assistant forward's logits."""
    proposals: list[list[Proposal]] = []
    logits: list[torch.Tensor] = []
    propose, run = proposer.propose, proposer._run

    def recorded_propose(batch: list[ScheduledSeq]) -> list[Proposal]:
        out = propose(batch)
        proposals.append(out)
        return out

    def recorded_run(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        out = run(*args)  # type: ignore[arg-type]
        logits.append(out[0].clone())
        return out

    proposer.propose, proposer._run = recorded_propose, recorded_run  # type: ignore[method-assign]
    return proposals, logits


@pytest.mark.parametrize(
    ("target", "head"), [("plain", "dense"), ("plain", "ordered"), ("small", "dense")]
)
def test_drafts_equal_transformers_candidate_generator(
    target: str,
    head: str,
    target_dir: Path,
    small_dir: Path,
    assistant_dir: Path,
    ordered_dir: Path,
) -> None:
    """Four prompts batched (three past the window of 8): after the prompt's step, each request
    drafts K tokens behind the target's first token; they and their logits are transformers'."""
    draft_dir = assistant_dir if head == "dense" else ordered_dir
    target_dir = target_dir if target == "plain" else small_dir
    engine = make_engine(target_dir, speculative=_spec(draft_dir))
    proposals, logits = _record(_proposer(engine))
    prompts = [random_prompts(1, (n, n), VOCAB, seed=n)[0] for n in (20, 5, 13, 33)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(K + 2))
    seqs = list(engine.seqs.values())
    engine.step()  # the prompts
    engine.step()  # the first decodes, with drafts
    drafted = [p.token_ids for p in proposals[-1]]
    assert all(len(d) == K for d in drafted)
    ours = torch.stack(logits[-K:], dim=1)  # [requests, K, vocab]
    for r, (prompt, seq) in enumerate(zip(prompts, seqs, strict=True)):
        tokens, ref = _hf_candidates(target_dir, draft_dir, prompt, seq.output_token_ids[0])
        assert drafted[r] == tokens
        finite = torch.isfinite(ref)
        assert (ours[r] - ref)[finite].abs().max().item() < 1e-4


# ---- lossless ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 6])
def test_greedy_equals_plain(
    batch: int, plain: LLMEngine, target_dir: Path, assistant_dir: Path
) -> None:
    """Mixed k per request (0: plain), then the same prompts again from the prefix cache."""
    engine = make_engine(target_dir, speculative=_spec(assistant_dir))
    prompts = random_prompts(batch, (1, 30), VOCAB, seed=61)
    ks = [None, 0, 1, 2, 3, None][:batch]
    seqs = engine.generate(prompts, [greedy(MAX_TOKENS, num_speculative_tokens=k) for k in ks])
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert _drafted(seqs) > 0
    again = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [s.output_token_ids for s in again] == [s.output_token_ids for s in seqs]
    assert sum(s.num_cached_tokens for s in again) > 0 and _drafted(again) > 0
    assert engine.block_manager.usage == 0.0


def test_greedy_with_requests_joining_and_chunked_prefill(
    plain: LLMEngine, target_dir: Path, assistant_dir: Path
) -> None:
    """Prompts in chunks of 9 tokens; a new request joins every other step while the others
    draft, and a pool too small for all of them preempts and recomputes some."""
    engine = make_engine(
        target_dir, speculative=_spec(assistant_dir, k=3), num_kv_blocks=16,
        max_num_batched_tokens=9,
    )  # fmt: skip
    prompts = random_prompts(5, (6, 30), VOCAB, seed=43)
    waiting, seqs, steps, preempted = list(enumerate(prompts)), [], 0, 0
    while waiting or engine.has_unfinished():
        if waiting and steps % 2 == 0:
            i, prompt = waiting.pop(0)
            engine.add_request(f"join-{i}", prompt, greedy(MAX_TOKENS))
            seqs.append(engine.seqs[f"join-{i}"])
        engine.step()
        steps += 1
        preempted += engine.last_stats.num_preemptions if engine.last_stats else 0
    assert [s.output_token_ids for s in seqs] == outputs(plain, prompts, greedy(MAX_TOKENS))
    assert _drafted(seqs) > 0 and preempted > 0
    assert engine.block_manager.num_free_blocks == 16


def test_seeded_text_is_the_same_with_the_draft_on_and_off(
    plain: LLMEngine, target_dir: Path, assistant_dir: Path
) -> None:
    prompts = random_prompts(3, (4, 20), VOCAB, seed=83)
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, choice=c, ignore_eos=True)
        for c in range(3)
    ]
    off = [outputs(plain, [p], q)[0] for p, q in zip(prompts, params, strict=True)]
    seqs = make_engine(target_dir, speculative=_spec(assistant_dir)).generate(prompts, params)
    assert [s.output_token_ids for s in seqs] == off
    assert _drafted(seqs) > 0


def test_sampled_pairs_follow_the_target_distribution(
    target_dir: Path, assistant_dir: Path
) -> None:
    """Unseeded sampling: the assistant drafts t2 in the step after the prompt's, so the pair
    (t1, t2) went through rejection sampling with the assistant's q."""
    prompt = random_prompts(1, (12, 12), VOCAB, seed=47)[0]
    engine = make_engine(
        target_dir, speculative=_spec(assistant_dir, k=2), num_kv_blocks=4096,
        max_num_seqs=256, max_num_batched_tokens=8192,
    )  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=TEMPERATURE, ignore_eos=True)
    seqs = engine.generate([prompt] * NUM_SAMPLES, params)
    pairs = [(s.output_token_ids[0], s.output_token_ids[1]) for s in seqs]
    assert _drafted(seqs) >= NUM_SAMPLES and len(set(pairs)) > 10
    assert chi_square_pvalue(pairs, exact_pair_probs(target_dir, prompt)) > 1e-3


def test_planned_drafts_stay_lossless(
    plain: LLMEngine, target_dir: Path, assistant_dir: Path
) -> None:
    """The adaptive planner prices the assistant's forwards as the draft's (calibrated at start)."""
    engine = make_engine(target_dir, speculative=_spec(assistant_dir, adaptive=True))
    assert engine.costs.draft.points  # calibrated
    prompts = random_prompts(4, (3, 25), VOCAB, seed=71)
    assert outputs(engine, prompts, greedy(MAX_TOKENS)) == outputs(
        plain, prompts, greedy(MAX_TOKENS)
    )


# ---- refusals ----------------------------------------------------------------------------------


def _refused(target: Path, draft: Path, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_engine(target, speculative=_spec(draft))


def test_what_does_not_fit_is_refused(
    target_dir: Path, assistant_dir: Path, tmp_path: Path
) -> None:
    _refused(target_dir, target_dir, "not a Gemma 4 assistant draft")
    qwen = make_tiny_model(tmp_path / "qwen3", family="qwen3")
    _refused(qwen, assistant_dir, "drafts for a Gemma 4 target")
    wide = _tiny_gemma4(tmp_path / "wide", seed=5, hidden_size=96)
    _refused(wide, assistant_dir, "target hidden size 64 \\(target 96\\)")
    other_window = _tiny_gemma4(tmp_path / "window", seed=6, sliding_window=4)
    _refused(other_window, assistant_dir, "sliding window 8 \\(target 4\\)")
    with pytest.raises(ValueError, match="needs a draft_model"):
        SpeculativeConfig(method="gemma4-assistant")
