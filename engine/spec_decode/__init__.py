"""Speculative decoding: who drafts, how many, and which drafts the target keeps.

Owns: the proposers (draft model, n-gram, hybrid, grammar-forced), each request's acceptance
record (`acceptance`), the per-step plan of drafts (`planner`) priced by measured forward costs
(`step_cost`), and the batched verification (`rejection_sampler`). May read a request's state and
call the model runner; never changes a request's progress (the scheduler does, from what the step
returns).
"""
