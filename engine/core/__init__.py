"""The engine loop and its request queues.

Owns: the waiting and running queues, admission and preemption (`scheduler`), KV block ids, ref
counts and prefix hashes (`block_manager`), the pool's size (`kv_sizing`), and the step loop that
ties schedule, propose, verify, accept and emit together (`llm_engine`, with `async_engine` as the
asyncio front). Does not touch tensors itself: it calls the model runner and the samplers with
what the scheduler planned.
"""
