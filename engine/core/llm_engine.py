"""LLMEngine: schedule, propose, verify, accept, emit."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

import torch

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.kv_sizing import num_kv_blocks
from engine.core.scheduler import Scheduler
from engine.kernels import gguf_ops
from engine.model import bundled
from engine.model import device as devices
from engine.model.eagle3 import load_eagle3_head
from engine.model.gemma4_assistant import load_gemma4_assistant
from engine.model.hybrid import HybridDecoderModel
from engine.model.loader import check_same_vocab, load_model
from engine.model.mtp import load_mtp_head
from engine.model.quantization import quantization_for
from engine.model.runner import ModelRunner
from engine.outputs import (
    ContextLengthError,
    RequestOutput,
    RequestTimes,
    SpecStats,
    StepStats,
    TokenLogprob,
)
from engine.sample import structured
from engine.sample.detokenizer import IncrementalDetokenizer
from engine.sample.sampler import logprobs_of
from engine.sample.sampling_params import SamplingParams
from engine.sample.seeded import SeedStream
from engine.sequence import ScheduledSeq, SeqResult, Sequence
from engine.spec_decode.planner import SpecPlanner
from engine.spec_decode.proposers import (
    DraftModelProposer,
    Eagle3Proposer,
    HybridProposer,
    MtpProposer,
    NgramProposer,
    NoProposer,
    Proposal,
    Proposer,
)
from engine.spec_decode.proposers.forced import ForcedDraftProposer
from engine.spec_decode.proposers.gemma4_assistant import Gemma4AssistantProposer
from engine.spec_decode.step_cost import StepCosts, calibrate, calibration_rows
from engine.spec_decode.verify import (
    Verified,
    draft_frontier,
    num_logits,
    verify_inputs,
    verify_step,
)

log = logging.getLogger("specserve.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        devices.make_current(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        log.info("loading target model %s", config.model)
        quantization = quantization_for(config.quantization, config.device, "target")
        self.target = ModelRunner(
            load_model(config.model, quantization),
            config.device,
            config.dtype,
            config.block_size,
        )
        self.tokenizer = self.target.tokenizer
        self.max_model_len = min(config.max_model_len or 1 << 30, self.target.max_model_len)
        self.eos_token_ids = frozenset(self.target.eos_token_ids)
        self.draft: ModelRunner | None = None
        spec = config.speculative
        self.costs = StepCosts()
        self.proposer: Proposer = ForcedDraftProposer(self._build_proposer())
        self.planner = (
            SpecPlanner(spec.proposers, self.costs, self._tree_width)
            if spec.enabled and spec.adaptive
            else None
        )
        num_blocks = self._num_kv_blocks()
        # a hybrid resumes a cached prefix only where its linear layers' state was snapshotted
        snapshots = config.num_state_snapshots if config.enable_prefix_caching else 0
        for runner in self._runners():
            runner.allocate_kv_cache(num_blocks)
            runner.allocate_states(config.max_num_seqs, snapshots)
            runner.warm_up()
        if isinstance(self._eagle3, Eagle3Proposer):
            self._eagle3.allocate(num_blocks, config.block_size)
        if self.planner is not None:
            self._calibrate(num_blocks)
        caching = config.enable_prefix_caching and (not self.target.is_hybrid or snapshots > 0)
        self.block_manager = BlockManager(num_blocks, config.block_size, caching)
        self.scheduler = Scheduler(
            config,
            self.block_manager,
            self.max_model_len,
            self.planner,
            self.eos_token_ids,
            self.target.num_state_slots,
            snapshots,
        )
        self.seqs: dict[str, Sequence] = {}
        self.last_stats: StepStats | None = None
        log.info("engine ready: %d KV blocks of %d tokens", num_blocks, config.block_size)

    # ---- public API ------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.validate(prompt_token_ids, params)
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        stop = params.stop
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            times=RequestTimes(arrival=time.monotonic()),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                list(prompt_token_ids),
                stop,
                params.skip_special_tokens,
                track_tokens=params.token_origins,
                kept_special_ids=params.kept_special_ids,
            ),
            seed_stream=None if params.seed is None else SeedStream.of(params.seed, params.choice),
            num_speculative_tokens=self.scheduler.request_k(params),
            constraint=structured.new_state(params.constraints, self.tokenizer),
        )
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request this engine can never serve: the one check of a
        request's length (the server calls it before a stream starts, `add_request` at admission)."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.constraints is not None and any(
            not 0 <= t < vocab for t, _ in params.constraints.logit_bias
        ):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(len(prompt_token_ids), params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(f"prompt plus max_tokens ({total} tokens) exceeds the KV cache")

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        self.target.restore_states(batch.state_restores)  # a hybrid's prefix-cache hits
        if self.planner is not None:
            self.planner.plan(batch.scheduled, self._ngram_drafts)
        planned = time.perf_counter()
        proposals = self.proposer.propose(batch.scheduled)
        drafted = time.perf_counter()
        logits = self.target.forward(verify_inputs(batch.scheduled, proposals))
        stats = self._accept(batch.scheduled, proposals, logits)
        self.target.commit_states(self.scheduler.state_commits(batch.scheduled))  # hybrid rollback
        stats.num_preemptions = batch.num_preempted
        self._observe(time.perf_counter() - started, drafted - planned, stats)
        self.last_stats = stats
        return [self._output(item.seq) for item in batch.scheduled if self._has_news(item.seq)]

    def _observe(self, step_seconds: float, propose_seconds: float, stats: StepStats) -> None:
        """Feed the step's measured forwards to the cost curves (`CostCurve.track`). The target's
        forward corrects the price of its row count only in a step of decodes (prompt rows need no
        logits: a cheaper shape), and the curve's level only where it verified no drafts."""
        if self.planner is None:
            return
        target = self.target.take_timings()
        if not stats.num_prompt_tokens:
            for rows, seconds in target:
                self.costs.target.track(rows, seconds, sets_level=not stats.spec.num_draft_tokens)
        drafts = self._draft_timings()
        if log.isEnabledFor(logging.DEBUG):  # every step: build the lists only when logged
            log.debug(
                "step %.3f s: target (rows, s) %s, draft %s, %d drafted",
                step_seconds,
                [(rows, round(s, 3)) for rows, s in target],
                [(rows, round(s, 3)) for rows, s in drafts],
                stats.spec.num_draft_tokens,
            )
        for rows, seconds in drafts:
            self.costs.draft.track(rows, seconds)
        self.costs.observe_step(
            step_seconds,
            sum(seconds for _, seconds in target),
            [seconds for _, seconds in drafts],
            propose_seconds,
        )

    def _draft_timings(self) -> list[tuple[int, float]]:
        """(rows, seconds) of the draft model's or the EAGLE-3 head's forwards since last asked."""
        if self.draft is not None:
            return self.draft.take_timings()
        return self._eagle3.take_timings() if self._eagle3 is not None else []

    def _ngram_drafts(self, item: ScheduledSeq) -> int:
        """How many drafts an n-gram lookup finds for the request now (0 without an n-gram proposer)."""
        ngram = self._ngram
        return len(ngram.propose_one(item).token_ids) if ngram is not None else 0

    def _calibrate(self, num_blocks: int) -> None:
        """Measure each model's step cost against its rows before any request runs: the target up
        to the rows of a full drafting step, the draft also up to a step's token budget, the size
        of its catch-ups on prompts, as prompt forwards (one logit): extrapolated from decode
        rows, each with its logits, a catch-up was priced at twice its cost."""
        k = self.config.speculative.num_speculative_tokens
        step_rows = self.config.max_num_seqs * (k + 1)
        catch_up_rows = max(step_rows, self.config.max_num_batched_tokens)
        log.info(
            "measuring step costs (target forwards at 1..%d rows, draft at 1..%d)",
            step_rows,
            catch_up_rows,
        )
        for runner, curve, max_rows in (
            (self.target, self.costs.target, step_rows),
            (self.draft, self.costs.draft, catch_up_rows),
        ):
            if runner is not None:
                rows = calibration_rows(max_rows)
                calibrate(curve, runner, rows, num_blocks, prompt_rows_from=step_rows + 1)
                runner.timings = []
        if self._eagle3 is not None:  # the head's forwards are priced as the draft's
            head_rows = calibration_rows(min(catch_up_rows, self.max_model_len))
            for num_rows, seconds in self._eagle3.calibrate(head_rows):
                self.costs.draft.observe(num_rows, seconds)
            self._eagle3.timings = []

    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Sequence]:
        """Run prompts to completion (offline use and tests); returns the finished sequences."""
        prompts = list(prompts)
        per = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, per, strict=True):
            self.add_request(rid, prompt, p)
        seqs = [self.seqs[rid] for rid in ids]
        while any(not seq.is_finished for seq in seqs):
            self.step()
        return seqs

    # ---- the speculative step --------------------------------------------------------------

    def _accept(
        self,
        batch: list[ScheduledSeq],
        proposals: list[Proposal],
        logits: torch.Tensor,  # [sum(num_logits), vocab_size]
    ) -> StepStats:
        verified = verify_step(batch, proposals, logits)
        spec, num_prompt, num_emitted, offset = SpecStats(), 0, 0, 0
        for item, proposal, outcome in zip(batch, proposals, verified, strict=True):
            rows = logits[offset : offset + num_logits(item, proposal)]  # [num_logits, vocab_size]
            offset += rows.shape[0]
            num_prompt += item.num_prompt_tokens
            self.target.move_kv(item.seq.block_table, outcome.kv_moves)
            num_emitted += self._accept_one(item, proposal, rows, outcome, spec)
        spec.num_emitted_tokens = num_emitted
        queried, hit = self.block_manager.take_lookup_stats()
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.block_manager.usage,
            num_prompt_tokens=num_prompt,
            num_generation_tokens=num_emitted,
            spec=spec,
            prefix_cache_queries=queried,
            prefix_cache_hits=hit,
            num_preemptions=0,
            spec_k_chosen=[item.num_spec_tokens for item in batch if item.reaches_end],
        )

    def _accept_one(
        self,
        item: ScheduledSeq,
        proposal: Proposal,
        rows: torch.Tensor,  # [num_logits, vocab_size]: prompt positions (echo), then k + 1 verify rows
        outcome: Verified,
        step_spec: SpecStats,
    ) -> int:
        """Hand one request's verified tokens to the scheduler; returns the tokens emitted."""
        seq, k = item.seq, len(proposal.token_ids)
        prompt_logprobs = (
            self._prompt_logprobs(seq, rows[: item.num_new_tokens])
            if seq.wants_prompt_logprobs
            else []
        )
        result = SeqResult(
            outcome.tokens,
            k,
            proposal.source,
            draft_frontier(proposal, outcome),
            outcome.logprobs,
            prompt_logprobs,
        )
        if item.reaches_end:
            tree = proposal.tree  # acceptance by depth: a tree's deepest node, else k
            depth = None if tree is None else tree.max_depth
            step_spec.add(result.num_drafts, result.num_accepted, result.proposer, depth)
        return self.scheduler.update_from_output(item, result)

    def _prompt_logprobs(self, seq: Sequence, rows: torch.Tensor) -> list[TokenLogprob]:
        """rows[j] is the forward at position start + j: it scores the prompt token after it."""
        start = seq.num_computed_tokens
        targets = [p + 1 for p in range(start, start + rows.shape[0])]
        keep = [
            j
            for j, t in enumerate(targets)
            if len(seq.prompt_logprobs) <= t < seq.num_prompt_tokens
        ]
        if not keep:
            return []
        ids = [seq.token_ids[targets[j]] for j in keep]
        return logprobs_of(rows[keep], ids, seq.params.prompt_logprobs or 0)

    # ---- outputs ---------------------------------------------------------------------------

    @staticmethod
    def _has_news(seq: Sequence) -> bool:
        return bool(seq.pending_token_ids) or seq.is_finished

    def _output(self, seq: Sequence) -> RequestOutput:
        first = not seq.first_output_sent
        seq.first_output_sent = True
        text_start = seq.detokenizer.num_sent
        new_text = seq.detokenizer.pop_delta(seq.is_finished)
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            new_text=new_text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            spec=seq.spec,
            times=seq.times,
            step_time=time.monotonic(),
            new_logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs
            if first and seq.params.prompt_logprobs is not None
            else None,
            prompt_token_ids=seq.prompt_token_ids if first else None,
            new_token_spans=seq.pending_spans(text_start, new_text)
            if seq.params.token_origins
            else None,
        )
        seq.pending_token_ids, seq.pending_logprobs = [], []
        if seq.is_finished:
            self.seqs.pop(seq.request_id, None)
        return out

    # ---- construction ----------------------------------------------------------------------

    def _build_proposer(self) -> Proposer:
        spec = self.config.speculative
        if spec.tree_width > 1 and not self._verifies_trees():
            log.info("draft trees off: %s verifies chains only", self.config.model)
            spec = dataclasses.replace(spec, tree_width=1)
        self._ngram = NgramProposer(spec) if "ngram" in spec.proposers else None
        self._tree_width = spec.tree_width
        # the proposer reading the target's kept hidden states, priced as the draft
        self._eagle3: Eagle3Proposer | Gemma4AssistantProposer | None = None
        if spec.method == "ngram":
            return self._ngram  # type: ignore[return-value]
        if "eagle3" in spec.proposers:
            head = self._eagle3_proposer()
            return head if self._ngram is None else HybridProposer(self._ngram, head)
        if spec.method == "mtp":
            return self._mtp_proposer()
        if spec.method == "gemma4-assistant":
            return self._assistant_proposer()
        if spec.method not in ("draft", "hybrid"):
            return NoProposer()
        assert spec.draft_model is not None
        log.info("loading draft model %s", spec.draft_model)
        quantization = quantization_for(self.config.draft_quantization, self.config.device, "draft")
        loaded = load_model(spec.draft_model, quantization)
        check_same_vocab(self.tokenizer, loaded.tokenizer)
        self.draft = ModelRunner(
            loaded,
            self.config.device,
            self.config.dtype,
            self.config.block_size,
            head_rows=spec.draft_vocab_size,
            compile_decode=spec.draft_compile,
        )
        draft = DraftModelProposer(self.draft, spec.draft_p_min, spec.tree_width)
        self._tree_width = draft.tree_width  # a windowed draft grows chains
        return draft if self._ngram is None else HybridProposer(self._ngram, draft)

    def _eagle3_proposer(self) -> Eagle3Proposer:
        """The head reads the target's hidden states, which the target now keeps by position."""
        path = self.config.speculative.draft_model
        assert path is not None
        log.info("loading EAGLE-3 head %s", path)
        model = self.target.model
        head = load_eagle3_head(
            str(bundled.head_folder(path)),
            model.embed_tokens,
            model.shape.hidden_size,
            model.shape.vocab_size,
            self.max_model_len,
            self.target.device,
            self.target.dtype,
            native=self._native_head(),
        )
        self.target.keep_aux_hidden(head.config.aux_layers(model.shape.num_layers))
        self._eagle3 = Eagle3Proposer(head, self.target, self._tree_width)
        return self._eagle3

    def _native_head(self) -> bool:
        """An EAGLE-3 head on the native kernels (Q8_0) where the draft's quantization would put
        a draft model's blocks there: a CPU with the kernels, `gguf` or `auto`."""
        native = self.config.draft_quantization in ("gguf", "auto") and gguf_ops.available()
        return native and self.target.device.type == "cpu"

    def _mtp_proposer(self) -> Eagle3Proposer:
        """The target's own MTP layer, from its checkpoint, reading its final hidden states."""
        model = self.target.model
        if not isinstance(model, HybridDecoderModel):
            raise ValueError(f"--speculative-method mtp: {self.config.model} has no MTP layers")
        head = load_mtp_head(model, self.target.loaded.iter_weights())
        self.target.keep_aux_hidden((model.shape.num_layers,))
        self._tree_width = 1  # MTP and the Gemma 4 assistant draft chains
        self._eagle3 = MtpProposer(head, self.target)
        return self._eagle3

    def _assistant_proposer(self) -> Gemma4AssistantProposer:
        """Gemma 4's assistant draft: reads the target's K/V in place and its final hidden
        states, which the target now keeps by position."""
        path = self.config.speculative.draft_model
        assert path is not None
        log.info("loading Gemma 4 assistant draft %s", path)
        target = self.target
        assistant = load_gemma4_assistant(path, target.hf_config, target.device, target.dtype)
        target.keep_aux_hidden((target.model.shape.num_layers,))
        self._eagle3 = Gemma4AssistantProposer(assistant, target)
        self._tree_width = 1
        return self._eagle3

    def _verifies_trees(self) -> bool:
        """A tree's mask hides keys by node, not by window; a sharded target's ranks are not led
        the K/V moves of an accepted path; a hybrid's recurrent state follows one chain."""
        target = self.target
        return (
            target.tp is None and target.model.shape.sliding_window is None and not target.is_hybrid
        )

    def _runners(self) -> list[ModelRunner]:
        return [self.target] if self.draft is None else [self.target, self.draft]

    def _num_kv_blocks(self) -> int:
        """Target and draft (or a head) share block ids, so one block costs every pool's bytes."""
        per_block = sum(runner.kv_bytes_per_block for runner in self._runners())
        if isinstance(self._eagle3, Eagle3Proposer):
            per_block += self._eagle3.kv_bytes_per_slot * self.config.block_size
        return num_kv_blocks(self.config, per_block)
