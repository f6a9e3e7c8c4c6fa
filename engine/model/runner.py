"""The model runner: owns the weights and the paged KV cache tensors, runs one ragged forward."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.kernels import attention_ops
from engine.kernels.memory import empty_huge
from engine.model import decoder_stack
from engine.model.attention import AttentionMetadata, RequestSpan
from engine.model.decode_graph import DecodeGraph
from engine.model.decoder import DecoderModel, KVCache
from engine.model.device import TimingMark, drain_timings, start_timing, stop_timing
from engine.model.families import build_decoder
from engine.model.hybrid import HybridDecoderModel, num_kv_layers
from engine.model.loader import LoadedModel
from engine.model.quant.native import forward_chunks, pack_on_huge_pages
from engine.model.quantize import (
    WeightSummary,
    gguf_kernels,
    quantize_mode,
    summarize,
    swap_in_quantized,
)
from engine.model.rope import rope_positions_limit
from engine.model.sharding import shard_decoder
from engine.model.state_pool import StateBatch, StateCommit, StatePool, StateRestore
from engine.model.tensor_parallel import TensorParallel, tensor_parallel_for

log = logging.getLogger("specserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Chat-turn terminators that end generation when the chat template uses them.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<turn|>")
# End-of-document tokens that end generation whenever the tokenizer has them as special tokens
# (Qwen's own generation config lists <|endoftext|> next to <|im_end|>).
_DOCUMENT_END_TOKENS = ("<|endoftext|>", "<|end_of_text|>")


@dataclass(frozen=True)
class ForwardInput:
    token_ids: list[int]  # the tokens to compute this pass (new tokens only)
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]  # block ids covering positions [0, start_pos + len(token_ids))
    num_logits: int  # logits wanted for the last num_logits positions (0..len)
    # Trailing drafted tokens (a verify's). Behind a chunk of several known tokens (a prompt's
    # last) they attend, and take the GEMM path, as a query of their own: each row then runs on
    # the kernels it runs on in plain decoding, so speculation changes no output.
    num_drafts: int = 0
    # The drafts form a tree (engine/spec_decode/proposers/tree.py): each draft's parent among
    # them, -1 for the token before the drafts. Draft i is rotated at its depth's position but
    # its K/V goes to the slot of position start_pos + known + i, and it attends to its
    # ancestors only. None: a chain.
    draft_parents: tuple[int, ...] | None = None
    # A hybrid model's request: its slot in the runner's StatePool (engine.model.state_pool),
    # which the scheduler hands out; None: a scratch slot (the start-up timing forwards).
    state_slot: int | None = None

    def positions(self) -> list[int]:
        """The rope position of each token: consecutive, except a tree's drafts (by depth)."""
        n = len(self.token_ids)
        if self.draft_parents is None:
            return list(range(self.start_pos, self.start_pos + n))
        known = n - self.num_drafts
        depths: list[int] = []
        for p in self.draft_parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        base = self.start_pos + known - 1
        return list(range(self.start_pos, base + 1)) + [base + d for d in depths]


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        device: str,
        dtype: str,
        block_size: int,
        head_rows: int | None = None,  # score only the first token ids and the stop ids (a draft)
        compile_decode: bool = False,  # one request's decode through a compiled graph (a draft)
    ) -> None:
        self.loaded = loaded
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.block_size = block_size
        self.tp = tensor_parallel_for(loaded.name)  # sharded target, or None
        head = None if head_rows is None else (head_rows, self.eos_token_ids)
        self.model = _build_model(loaded, self.device, self.dtype, self.tp, head)
        self.weights: WeightSummary = summarize(self.model)
        # layers of two kinds (Gemma 3's windows, SmolLM3's NoPE) run the eager loop: the
        # graph of a run of layers assumes they differ only in weights
        compile_decode = compile_decode and self.model.shape.layers_alike
        self.decode_graph = DecodeGraph(self.model) if compile_decode else None
        self.model.compiled_layers = self.decode_graph
        if self.device.type == "cpu":
            attention_ops.available()  # build or load the kernels now, not in the first step
        log.info(
            "%s runs as %s (%s): %.2f GiB of weights",
            loaded.name,
            self.weights.label,
            dtype,
            self.weights.weight_bytes / (1 << 30),
        )
        self.kv_caches: list[KVCache] = []
        # An EAGLE-3 head's features, the target's aux hidden states [num_slots, n * hidden], kept
        # by position like K/V (slot = block id * block_size + offset): a rejected draft's row is
        # overwritten later, a prefix-cached block's rows are the ones computed for its tokens.
        self.aux_pool: torch.Tensor | None = None
        # (rows, start, stop) of each forward since the engine last took them; None: not timed.
        # Marks, not seconds: on CUDA they are events, read once per step (take_timings).
        self.timings: list[tuple[int, TimingMark, TimingMark]] | None = None
        # a hybrid model's linear-attention states, one slot per running request
        self.states: StatePool | None = None

    @property
    def hf_config(self) -> PretrainedConfig:
        return self.loaded.hf_config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.loaded.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    @property
    def max_model_len(self) -> int:
        limit = int(self.hf_config.max_position_embeddings)
        limit = min(limit, rope_positions_limit(self.hf_config) or limit)
        if self.model.shape.sliding_window is not None:
            return limit  # its layers' windows are honoured (Gemma 3, gpt-oss, Mistral, Qwen2)
        window = getattr(self.hf_config, "sliding_window", None)
        uses_window = getattr(self.hf_config, "use_sliding_window", True)
        types = getattr(self.hf_config, "layer_types", None)
        if types is not None and "sliding_attention" not in types:
            return limit  # transformers windows none of its layers (Qwen2's max_window_layers)
        # Other families' windows (Phi-3's) are not kept here: past them the model would be wrong.
        return min(limit, int(window)) if window and uses_window else limit

    @property
    def eos_token_ids(self) -> list[int]:
        ids = list(self.loaded.generation_eos_ids)
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids += [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        ids += _turn_end_ids(self.tokenizer)
        return sorted(set(ids))

    @property
    def kv_bytes_per_block(self) -> int:
        s = self.model.shape
        element = torch.empty((), dtype=self.dtype).element_size()
        aux = len(self.model.aux_layers) * s.hidden_size  # an EAGLE-3 head's features, if kept
        layers = (s.attention_shape(i) for i in range(num_kv_layers(self.model)))
        kv = 2 * sum(a.num_kv_heads * a.head_dim for a in layers)
        return (kv + aux) * self.block_size * element

    def keep_aux_hidden(self, layers: tuple[int, ...]) -> None:
        """Keep the stream entering these layers for every position computed (an EAGLE-3 head's
        features; call before allocate_kv_cache)."""
        if self.tp is not None:
            raise ValueError("aux hidden states are not kept for a sharded model")
        if self.is_hybrid and layers != (self.model.shape.num_layers,):
            raise ValueError("a hybrid model keeps only its final hidden state (an MTP head's)")
        if not all(0 <= j <= self.model.shape.num_layers for j in layers):
            raise ValueError(f"aux layers {layers} not in [0, {self.model.shape.num_layers}]")
        self.model.aux_layers = tuple(sorted(set(layers)))

    def aux_hidden(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """The kept aux hidden states of positions [start, end): [end - start, n * hidden]."""
        assert self.aux_pool is not None, "keep_aux_hidden and allocate_kv_cache first"
        return self.aux_pool[self._slots(block_table, list(range(start, end)))]

    def move_kv(self, block_table: list[int], moves: list[tuple[int, int]]) -> None:
        """Copy K/V (and kept aux hidden states) from position `src` to `dst` for each
        (src, dst): a draft tree's accepted path, put in position order after its verify."""
        if not moves:
            return
        if self.tp is not None:
            raise ValueError("K/V moves are not led to a sharded model's ranks")
        src, dst = (self._slots(block_table, [m[i] for m in moves]) for i in (0, 1))
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                flat = cache.view(cache.shape[0], -1, cache.shape[-1])  # [kv_heads, slots, dim]
                flat[:, dst] = flat[:, src]  # the right side is gathered first: overlaps are safe
        if self.aux_pool is not None:
            self.aux_pool[dst] = self.aux_pool[src]

    def _slots(self, block_table: list[int], positions: list[int]) -> torch.Tensor:
        pos = torch.tensor(positions, dtype=torch.int64)
        blocks = torch.tensor(block_table, dtype=torch.int64)[pos // self.block_size]
        return (blocks * self.block_size + pos % self.block_size).to(self.device)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        if self.tp is not None:
            self.tp.lead("allocate_kv_cache", num_blocks)
        s = self.model.shape
        # K and V tensors of their own, not views of one: a compiled graph (DecodeGraph) that
        # writes into a view of its input copies the whole base back (the pool, every layer)
        self.kv_caches = []
        for i in range(num_kv_layers(self.model)):
            a = s.attention_shape(i)  # Gemma 4's full-attention layers: their own head size
            shape = (a.num_kv_heads, num_blocks, self.block_size, a.head_dim)
            self.kv_caches.append((self._zeros(shape), self._zeros(shape)))
        if self.model.aux_layers:
            width = len(self.model.aux_layers) * s.hidden_size
            self.aux_pool = self._zeros((num_blocks * self.block_size, width))

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return empty_huge(shape, self.dtype).zero_()  # 2 MB pages: one TLB entry per 2 MB read

    def warm_up(self) -> None:
        """Compile the decode graph, if any (after allocate_kv_cache). Its forwards read block 0
        and write K/V in block 1, blocks no request owns yet."""
        if self.decode_graph is not None:
            start = self.block_size  # two blocks of context: no size of one to specialize on
            self.decode_graph.warm_up(
                lambda n: self.forward([ForwardInput([0] * n, start, [0, 1], 1)])
            )

    @torch.inference_mode()
    def forward(
        self, inputs: list[ForwardInput], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """-> [sum(num_logits), vocab_size] float32, in input order.

        `input_ids` [num_tokens]: the flat token ids already on the device (a draft's last picks,
        never copied to the host); the inputs' token_ids then only count the tokens."""
        if not self.kv_caches:
            raise RuntimeError("allocate_kv_cache() before forward()")
        if self.tp is not None:
            if input_ids is not None:
                raise ValueError("a sharded model's ranks take token ids from the host")
            self.tp.lead("forward", inputs)
        if input_ids is None:
            inputs = [i for i in inputs if i.token_ids]
        if not inputs:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        started = start_timing(self.device) if self.timings is not None else None
        logits = self._forward(inputs, input_ids)
        if self.timings is not None and started is not None:
            rows = sum(len(i.token_ids) for i in inputs)
            self.timings.append((rows, started, stop_timing(self.device)))
        return logits

    def take_timings(self) -> list[tuple[int, float]]:
        """(rows, seconds) of each timed forward since the last call."""
        return drain_timings(self.timings)

    @property
    def is_hybrid(self) -> bool:
        """Linear-attention layers with a recurrent state per request (Qwen3.5)."""
        return isinstance(self.model, HybridDecoderModel)

    def allocate_states(self, num_slots: int, num_snapshots: int = 0) -> None:
        """A hybrid model's state pool, a slot per running request (max_num_seqs) and the prefix
        cache's snapshots; else nothing."""
        model = self.model
        if isinstance(model, HybridDecoderModel):
            if self.tp is not None:
                raise ValueError("tensor parallelism does not shard linear-attention layers")
            linear, n = model.linear_shape, len(model.linear_layers)
            shapes = (linear.conv_state_shape, linear.recurrent_state_shape)
            self.states = StatePool(*shapes, n, num_slots, self.device, self.dtype, num_snapshots)
            log.info(
                "%d state slots and %d prefix-cache snapshots: %.1f MiB",
                num_slots,
                num_snapshots,
                self.states.nbytes / (1 << 20),
            )

    @property
    def num_state_slots(self) -> int:
        return 0 if self.states is None else self.states.num_slots

    def restore_states(self, restores: list[StateRestore]) -> None:
        """Before a forward: newly admitted requests' slots from their prefixes' snapshots."""
        if self.states is not None:
            self.states.restore(restores)

    def commit_states(self, commits: list[StateCommit]) -> None:
        """After accept: each verified request's state at its last accepted token (a hybrid's)."""
        if self.states is not None:
            self.states.commit(commits)

    def _state_batch(self, inputs: list[ForwardInput]) -> list[StateBatch]:
        if self.states is None:
            return []
        if any(i.draft_parents is not None for i in inputs):
            raise ValueError("draft trees need a state per branch: a hybrid model verifies chains")
        spans = [(len(i.token_ids), i.start_pos, i.state_slot, i.num_drafts) for i in inputs]
        return [self.states.batch(StateBatch.segments_of(spans, self.states.num_slots))]

    def _forward(
        self, inputs: list[ForwardInput], device_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        input_ids, positions, logit_rows = _flatten(inputs, self.block_size)
        if device_ids is not None:
            input_ids = device_ids  # [num_tokens], already on the device
        spans = [span for i in inputs for span in _spans(i)]
        # the compiled graph runs only batches of one request: only those need its one structure
        uniform = self.decode_graph is not None and len(spans) == 1
        window = self.model.shape.sliding_window
        meta = AttentionMetadata.build(spans, self.block_size, self.device, uniform, window)
        with forward_chunks([span.num_tokens for span in spans]):
            hidden = self.model(
                input_ids.to(self.device, non_blocking=True),
                positions.to(self.device, non_blocking=True),
                self.kv_caches,
                meta,
                *self._state_batch(inputs),
            )  # [num_tokens, hidden]
            if self.aux_pool is not None and self.model.aux_hidden is not None:
                self.aux_pool[meta.slot_mapping] = self.model.aux_hidden
                self.model.aux_hidden = None
            if logit_rows.numel() != hidden.shape[0]:
                hidden = hidden[logit_rows.to(self.device, non_blocking=True)]
            return self.model.compute_logits(hidden)


def _spans(inp: ForwardInput) -> list[RequestSpan]:
    """The attention's requests for one input: a chunk with drafts behind it is two."""
    n, drafts = len(inp.token_ids), inp.num_drafts
    if drafts == 0 or n - drafts <= 1:
        return [RequestSpan(inp.start_pos, n, inp.block_table, _tree_mask(inp, n - drafts))]
    known = n - drafts
    return [
        RequestSpan(inp.start_pos, known, inp.block_table),
        RequestSpan(inp.start_pos + known, drafts, inp.block_table, _tree_mask(inp, 0)),
    ]


def _tree_mask(inp: ForwardInput, known: int) -> torch.Tensor | None:
    """[known + drafts, known + drafts] bool for a span of `known` tokens (0 or 1) and the
    drafts behind them: causal among the known, a draft sees them, its ancestors and itself."""
    if inp.draft_parents is None:
        return None
    n = known + inp.num_drafts
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    for i, p in enumerate(inp.draft_parents):
        row = known + i
        mask[row, known:] = False
        if p >= 0:
            mask[row, known : known + p + 1] = mask[known + p, known : known + p + 1]
        mask[row, row] = True
    return mask


def _flatten(
    inputs: list[ForwardInput], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat token ids [T], positions [T] and the rows whose logits are wanted [N]."""
    ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    for inp in inputs:
        n = len(inp.token_ids)
        if not 0 <= inp.num_logits <= n:
            raise ValueError(f"num_logits {inp.num_logits} not in [0, {n}]")
        if len(inp.block_table) * block_size < inp.start_pos + n:
            raise ValueError(f"block table of {len(inp.block_table)} blocks too short")
        rows.extend(range(len(ids) + n - inp.num_logits, len(ids) + n))
        ids.extend(inp.token_ids)
        positions.extend(inp.positions())
    as_long = torch.int64
    return (
        torch.tensor(ids, dtype=as_long),
        torch.tensor(positions, dtype=as_long),
        torch.tensor(rows, dtype=as_long),
    )


def _build_model(
    loaded: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel | None,
    head: tuple[int, list[int]] | None,  # DecoderModel.limit_head's rows and extra ids
) -> DecoderModel:
    with torch.device("meta"):
        model = build_decoder(loaded.architecture, loaded.hf_config)
        if head is not None:
            model.limit_head(*head)
    mode = quantize_mode(loaded.quantization, from_gguf=loaded.gguf_file is not None)
    if mode is not None:
        if tp is not None:
            raise ValueError("tensor parallelism shards plain linear layers: use quantization none")
        swap_in_quantized(model, mode, dtype, device)
    # A sharded model loads whole in host memory, then only this rank's shard goes to the device.
    model = model.to(dtype).to_empty(device="cpu" if tp is not None else device)
    model.load_weights(loaded.iter_weights())
    if tp is not None:
        shard_decoder(model, tp)
        model = model.to(device)
    model.init_rotary(loaded.hf_config, device)
    if tp is None:
        if device.type == "cpu":
            pack_on_huge_pages(gguf_kernels(model))
        model.native_stack = decoder_stack.build(model)
    _return_freed_memory()
    return model.eval()


def _return_freed_memory() -> None:
    """Loading frees gigabytes of transient tensors (raw blocks, unpacked values) that glibc
    would otherwise keep in the process: hand them back so resident memory is the model's."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _turn_end_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    template = getattr(tokenizer, "chat_template", None) or ""
    special = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
    vocab = tokenizer.get_vocab()
    turn_ends = [t for t in _TURN_END_TOKENS if t in vocab and t in template]
    doc_ends = [t for t in _DOCUMENT_END_TOKENS if t in vocab and t in special]
    return [vocab[t] for t in turn_ends + doc_ends]
