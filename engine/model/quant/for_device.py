"""Which quantization a model really loads with on its device.

The int8 kernels here are CPU kernels: fbgemm's (`w8a8`, `w8a8-fast`) exists only on x86 CPUs,
and aten's weight-only int8 GEMM on CUDA computes one output per thread in float32 without
tensor cores, slower than bf16 on cuBLAS for every row count a step has (1 to 512). So on CUDA
those settings, and `auto` (a GGUF's Q5_0/Q6_K/Q8_0 blocks would go to that same int8 GEMM),
load dense weights in the configured dtype, with one log line. `int4` stays: it runs on torch's
tinygemm kernel, which is a CUDA kernel (its speed against bf16 is unmeasured here).
"""

from __future__ import annotations

import logging

from engine.config import Quantization
from engine.model import device as devices

log = logging.getLogger("specserve.quant")

CPU_ONLY: tuple[Quantization, ...] = ("auto", "int8", "w8a8", "w8a8-fast")


def quantization_for(quantization: Quantization, device: str, role: str = "model") -> Quantization:
    """`quantization` as the weights of `role` ("target", "draft") load on `device`."""
    if not devices.is_cuda(device) or quantization not in CPU_ONLY:
        return quantization
    log.info(
        "%s: quantization %s runs on CPU int8 kernels; on %s its weights load dense (none)",
        role, quantization, device,
    )  # fmt: skip
    return "none"
