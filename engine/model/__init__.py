"""The model side: everything that owns tensors.

Owns: the model runner and its KV pool (`runner`), the decoder and its model families (`decoder`,
`families`), paged attention (`attention`), the draft's compiled decode graph (`decode_graph`),
weight loading (`loader`, `quant/` for GGUF and quantized layers), tensor parallelism
(`parallel/`), the bundled model pair (`bundled`) and what the engine asks of its device
(`device`: synchronize, free memory, the current device, timing, whether host reads are free).
Knows nothing of requests beyond the token spans a forward is given.
"""
