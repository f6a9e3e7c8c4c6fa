"""Engine configuration: small frozen dataclasses, validated once where they are built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

SpecMethod = Literal[
    "none", "draft", "ngram", "hybrid", "eagle3", "hybrid-eagle3", "mtp", "gemma4-assistant"
]
# The proposers each method runs: hybrid takes an n-gram match where there is one, else the draft;
# eagle3 an EAGLE-3 head (draft_model: its folder) reading the target's hidden states, and
# hybrid-eagle3 an n-gram match where there is one, else the head; mtp the target's own
# multi-token-prediction layer (Qwen3.5's, from its checkpoint); gemma4-assistant Gemma 4's
# assistant draft (draft_model: its folder) reading the target's K/V and last hidden state.
PROPOSERS: dict[str, tuple[str, ...]] = {
    "none": (),
    "draft": ("draft",),
    "ngram": ("ngram",),
    "hybrid": ("ngram", "draft"),
    "eagle3": ("eagle3",),
    "hybrid-eagle3": ("ngram", "eagle3"),
    "mtp": ("mtp",),
    "gemma4-assistant": ("gemma4-assistant",),
}
# proposers whose draft_model must be given
NEEDS_DRAFT_MODEL = frozenset({"draft", "eagle3", "gemma4-assistant"})
# proposers that read the target's kept hidden states (no tensor parallelism yet)
READS_TARGET_STATE = frozenset({"eagle3", "mtp", "gemma4-assistant"})
Dtype = Literal["float32", "bfloat16", "float16"]
# auto: a GGUF's quantized tensors stay quantized (int4 for Q4_K, int8 for the others), float
# checkpoints stay float; none: everything dequantized to `dtype`; int8 / int4: float
# checkpoints rounded to nearest at load (GGUF files behave as with auto); w8a8: every matrix
# rounded to int8 per row and run with activations rounded to int8 per row in two passes (bf16's
# quality, fbgemm on x86 CPUs); w8a8-fast: one pass, 7-bit activations (for a draft model);
# gguf: a GGUF file's blocks kept byte for byte and run on the native kernels (engine/kernels),
# activations rounded to int8 per row and per block (auto's path where the kernels are missing).
Quantization = Literal["auto", "none", "int8", "int4", "w8a8", "w8a8-fast", "gguf"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod = "none"
    num_speculative_tokens: int = 4  # k: the most tokens proposed per request per step
    draft_model: str | None = None  # path, GGUF file, hub id or "bundled:<name>"
    draft_quantization: Quantization | None = None  # None: the target's
    ngram_min: int = 1
    ngram_max: int = 4
    # Speculation stops paying once the batch is large enough that a verify pass is compute-bound:
    # above this many running requests every request decodes plainly (0 = never disable).
    disable_by_batch_size: int = 0
    # Plan each step's drafts from measured forward costs and each request's acceptance
    # (engine/spec_decode/planner.py); off: every request drafts its k every step.
    adaptive: bool = True
    # Draft model: stop drafting a request once the draft's probability for its pick falls below this.
    draft_p_min: float = 0.0
    # Draft model: propose only from the first this many token ids (its head scores no others);
    # None: the whole vocabulary. See DecoderModel.limit_head.
    draft_vocab_size: int | None = None
    # Draft model: run one request's decode through a torch.compile'd graph (engine/model/decode_graph.py).
    draft_compile: bool = False
    # Branches a draft tree may hold (engine/spec_decode/proposers/tree.py): n-gram matches with
    # different continuations, or the EAGLE-3 head's or the draft model's top tokens per level,
    # verified in one forward within the same k nodes; 1: chains only.
    tree_width: int = 1

    def __post_init__(self) -> None:
        if self.method not in PROPOSERS:
            raise ValueError(
                f"speculative method must be one of {', '.join(PROPOSERS)}, not {self.method!r}"
            )
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if NEEDS_DRAFT_MODEL & set(self.proposers) and not self.draft_model:
            raise ValueError(f"speculative method {self.method!r} needs a draft_model")
        if not 0.0 <= self.draft_p_min < 1.0:
            raise ValueError("draft_p_min must be in [0, 1)")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError("draft_vocab_size must be >= 1 (or null: the whole vocabulary)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.tree_width < 1:
            raise ValueError("tree_width must be >= 1 (1: chains only)")
        if self.draft_quantization is not None:
            _check_quantization("draft_quantization", self.draft_quantization)

    @property
    def proposers(self) -> tuple[str, ...]:
        return PROPOSERS[self.method]

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0


@dataclass(frozen=True)
class EngineConfig:
    model: str  # path, GGUF file, hub id or "bundled:<name>"
    tokenizer: str | None = None  # defaults to the model's own
    device: str = "cpu"
    dtype: Dtype = "bfloat16"
    quantization: Quantization = "auto"  # the target's, and the draft's unless it sets its own
    block_size: int = 16
    kv_cache_gib: float = 2.0  # KV pool size (target and draft together)
    num_kv_blocks: int | None = None  # exact pool size in blocks; overrides the memory budget
    # On CUDA: the share of the device's memory this process may hold, weights included; the
    # pool gets kv_cache_gib or what is left under it, whichever is less (engine/core/kv_sizing.py).
    gpu_memory_utilization: float = 0.85
    max_model_len: int | None = None  # defaults to the model's context window
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # token budget of one step (chunked prefill above it)
    enable_prefix_caching: bool = True
    # A hybrid target's (Qwen3.5) prefix cache: how many linear-layer state snapshots it keeps,
    # each one request's whole state (~49 MiB at Qwen3.5's default sizes), LRU; 0: no prefix
    # caching for a hybrid target (docs/HYBRID.md)
    num_state_snapshots: int = 8
    num_threads: int | None = None  # torch intra-op threads on CPU
    seed: int = 0
    # Ranks the target is sharded over (engine/parallel); the draft runs whole on rank 0.
    tensor_parallel_size: int = 1
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be > 0")
        if self.num_state_snapshots < 0:
            raise ValueError("num_state_snapshots must be >= 0")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.tensor_parallel_size > 1 and READS_TARGET_STATE & set(self.speculative.proposers):
            raise ValueError(f"{self.speculative.method} does not run with tensor parallelism yet")
        if self.tensor_parallel_size > 1 and self.speculative.draft_model == self.model:
            raise ValueError("with tensor parallelism the draft must be a different model")
        _check_quantization("quantization", self.quantization)
        if self.quantization == "w8a8-fast":
            raise ValueError(
                "quantization w8a8-fast is for a draft model (draft_quantization): its 7-bit "
                "activations change ~4% of the target's greedy picks; use w8a8 for the target"
            )

    @property
    def draft_quantization(self) -> Quantization:
        return self.speculative.draft_quantization or self.quantization


def _check_quantization(name: str, value: str) -> None:
    if value not in QUANTIZATIONS:
        raise ValueError(f"{name} must be one of {', '.join(QUANTIZATIONS)}, not {value!r}")
