"""Tensor parallelism's processes: launching the ranks (`launch`) and the other ranks' loop
(`worker`). The shards themselves are `engine.model.sharding` (Megatron-style module swaps) and
`engine.model.tensor_parallel` (rank state), which the model runner uses below this package."""
