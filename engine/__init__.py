"""specserve's inference engine: continuous batching with exact speculative decoding.

Rooms, each owning one kind of state (imports only go down this list, never back up):

- `engine.core`: the engine loop and its queues (`LLMEngine`, `AsyncLLM`, `Scheduler`,
  `BlockManager`). The scheduler is the one writer of a request's progress.
- `engine.spec_decode`: speculation (proposers, the per-step planner and its cost curves,
  acceptance estimates, the rejection sampler).
- `engine.sample`: turning logits into tokens and tokens into text (sampler, sampling
  parameters, grammar constraints, detokenizer). Stateless but for the grammar matchers.
- `engine.model`: tensors (model runner, decoder, paged attention, loader, quantized layers,
  tensor parallelism, the bundled models).
- `engine.kernels`: native CPU kernels and their build.

Below them all: `engine.config` (frozen settings), `engine.outputs` (what the engine returns) and
`engine.sequence` (a request's state and the scheduler's `ScheduledSeq`, the typed values the
layers hand each other).
"""
