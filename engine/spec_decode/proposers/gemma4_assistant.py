"""Gemma 4's assistant draft as a proposer (`speculative_method: gemma4-assistant`).

A request drafts in a step that computes just its last token t at position P: the target has
computed [0, P), so its K/V of those positions is in the pool and its final hidden state at
P - 1 (kept by position, `ModelRunner.keep_aux_hidden`) is what predicted t. Each draft is one
forward of the assistant (engine/model/gemma4_assistant.py) at position P over that same K/V:
the first reads [embed(t) ; the target's normed hidden state at P - 1], each further one
[embed(its last draft) ; the state the assistant returned]. Nothing of the assistant's is kept
between steps (it computes no K/V), so there is nothing to catch up on or roll back: a rejected
draft simply was never in the target's pool.

All drafting requests run together, one assistant forward per draft over those still drafting;
drafts are picked as EAGLE-3's are (`eagle3.pick_drafts`: greedy, sampled after the request's
own sampling parameters, seeded with the noise of the position they fill, grammar-masked).
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.model import device as devices
from engine.model.attention import AttentionMetadata, RequestSpan
from engine.model.decoder import KVCache
from engine.model.device import TimingMark, drain_timings, start_timing, stop_timing
from engine.model.gemma4_assistant import Gemma4Assistant, KVSources
from engine.model.runner import ModelRunner
from engine.sequence import ScheduledSeq, Sequence
from engine.spec_decode.proposers.base import Proposal, picked_proposal, still_drafting
from engine.spec_decode.proposers.eagle3 import pick_drafts


class Gemma4AssistantProposer:
    name = "gemma4-assistant"

    def __init__(self, assistant: Gemma4Assistant, target: ModelRunner) -> None:
        self.assistant = assistant
        self.target = target  # keeps its final hidden states by position; owns the K/V pool
        self.sources = KVSources.of(target.hf_config)
        # (rows, start, stop) of each assistant forward since the engine last took them; None:
        # not timed (as Eagle3Proposer's)
        self.timings: list[tuple[int, TimingMark, TimingMark]] | None = None

    @torch.inference_mode()
    def propose(self, batch: list[ScheduledSeq]) -> list[Proposal]:
        """One assistant forward per draft, over every request still drafting."""
        active = [i for i, item in enumerate(batch) if self._drafts(item)]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        if active:
            seqs = [batch[i].seq for i in active]
            state = self._target_state(seqs)  # [R, target hidden]
            tokens = [s.token_ids[s.num_computed_tokens] for s in seqs]
            rows, step = active, 0
            while rows:
                seqs = [batch[i].seq for i in rows]
                positions = [s.num_computed_tokens for s in seqs]
                tables = [s.block_table for s in seqs]
                logits, state = self._run(positions, tables, tokens, state)
                drafted = pick_drafts(batch, rows, logits, drafts, probs)
                step += 1
                keep = still_drafting(batch, rows, drafted, step, self.name)
                rows, state = [rows[r] for r in keep], state[keep]
                tokens = [drafts[i][-1] for i in rows]
        return [
            picked_proposal(item, drafts.get(i), probs.get(i), self.name)
            for i, item in enumerate(batch)
        ]

    def _drafts(self, item: ScheduledSeq) -> bool:
        """Only a step that computes just the last token drafts: the target's state at P - 1
        and its K/V of [0, P) exist only then."""
        return (
            item.k_for(self.name) > 0
            and item.num_new_tokens == 1
            and item.seq.num_computed_tokens > 0
        )

    def _target_state(self, seqs: list[Sequence]) -> torch.Tensor:  # [R, target hidden]
        """The target's final hidden state at each request's P - 1, after its final norm (the
        runner keeps the stream before it)."""
        rows = [
            self.target.aux_hidden(s.block_table, s.num_computed_tokens - 1, s.num_computed_tokens)
            for s in seqs
        ]
        return self.target.model.norm(torch.cat(rows))

    def _run(
        self,
        positions: list[int],  # each row's P
        tables: list[list[int]],  # each row's block table
        tokens: list[int],  # each row's input token: the request's last, then its last draft
        state: torch.Tensor,  # [R, target hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [R, vocab] float32, state [R, target hidden]
        """One assistant forward, timed where the engine asks (its cost curve is the draft's)."""
        device = self.assistant.device
        started = start_timing(device) if self.timings is not None else None
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        inputs = torch.cat([self.target.model.embed(ids), state.to(device)], dim=-1)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        out = self.assistant(inputs, pos, self._kv(), self._metadata(positions, tables))
        if self.timings is not None and started is not None:
            self.timings.append((len(tokens), started, stop_timing(device)))
        return out

    def _metadata(self, positions: list[int], tables: list[list[int]]) -> AttentionMetadata:
        """Each row one query seeing the target's keys [0, P): to the attention, a decode at
        P - 1 whose own K/V is already in the pool (nothing is written: the layers are shared)."""
        spans = [RequestSpan(p - 1, 1, table) for p, table in zip(positions, tables, strict=True)]
        runner = self.target
        return AttentionMetadata.build(
            spans, runner.block_size, runner.device, sliding_window=self.assistant.window
        )

    def _kv(self) -> dict[str, KVCache]:
        return {kind: self.target.kv_caches[j] for kind, j in self.sources.by_type.items()}

    def take_timings(self) -> list[tuple[int, float]]:
        """(rows, seconds) of each timed assistant forward since the last call."""
        return drain_timings(self.timings)

    def calibrate(self, rows: list[int], rounds: int = 3) -> list[tuple[int, float]]:
        """(rows, seconds) of an assistant forward at each row count, the median of `rounds`
        after a warm-up, each row over two blocks of context (blocks 0 and 1, which no request
        owns yet): before any request runs."""
        width, device = self.target.model.shape.hidden_size, self.assistant.device
        measured = []
        for m in rows:
            args = ([2 * self.target.block_size] * m, [[0, 1]] * m, [0] * m)
            state, seconds = torch.zeros(m, width, device=device), []
            for _ in range(rounds + 1):
                devices.synchronize(device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self._run(*args, state)
                devices.synchronize(device)
                seconds.append(time.perf_counter() - t0)
            measured.append((m, statistics.median(seconds[1:])))
        return measured
