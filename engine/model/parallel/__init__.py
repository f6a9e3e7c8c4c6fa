"""Tensor parallelism on torch.distributed: Megatron-style shards of the target model."""

from engine.model.parallel.state import TensorParallel, set_tensor_parallel, tensor_parallel_for

__all__ = ["TensorParallel", "set_tensor_parallel", "tensor_parallel_for"]
