"""Quantized weights: formats, a raw GGUF reader, kernels and the layers that use them."""
