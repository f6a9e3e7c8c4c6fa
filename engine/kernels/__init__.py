"""Native CPU kernels (C++ with SIMD intrinsics, registered as torch custom ops) and their build.

The place for the kernels that torch's CPU ops do not cover well (quantized GEMMs on the GGUF's own
blocks, paged attention read in place). The Python side owns policy (which kernel for which rows);
the C++ side owns none. Nothing here is required: without a compiler or a supported CPU the model
layers fall back to torch's own kernels.
"""
