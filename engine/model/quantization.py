"""Which quantization a model really loads with: on its device, and for its weights.

`auto` means the fastest path for these weights on this machine. The engine asks
`quantization_for` (the device) before loading, and `load_model` asks `quantization_for_weights`
(the file) once it has found one:

- on CUDA, dense weights in the configured dtype (`none`). The int8 kernels here are CPU kernels:
  fbgemm's (`w8a8`, `w8a8-fast`) exists only on x86 CPUs, and aten's weight-only int8 GEMM on
  CUDA computes one output per thread in float32 without tensor cores, slower than bf16 on cuBLAS
  for every row count a step has (1 to 512); a GGUF's Q5_0/Q6_K/Q8_0 blocks would go to that same
  GEMM. So on CUDA those explicit settings load dense too, with one log line. `int4` stays: it
  runs on torch's tinygemm kernel, a CUDA kernel (its speed against bf16 is unmeasured here).
- a .gguf file where the native kernels load: the file's blocks on them (`gguf`).
- a .gguf file without them: its blocks on torch's int4/int8 kernels (`auto` stays `auto`).
- a float checkpoint: dense in the configured dtype (`none`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.config import Quantization
from engine.kernels import gguf_ops
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


def quantization_for_weights(quantization: Quantization, path: Path) -> Quantization:
    """`auto` and `gguf` as the weights at `path` load (the module's docstring says how `auto`
    resolves); `gguf` the kernels cannot run falls back to auto's choice. One log line each."""
    if quantization not in ("auto", "gguf"):
        return quantization
    if not (path.is_file() and path.suffix == ".gguf"):
        if quantization == "gguf":
            log.warning("quantization gguf: the model is not a .gguf file; it loads dense (none)")
        else:
            log.info("quantization auto: %s is not a .gguf file; it loads dense (none)", path.name)
        return "none"
    if gguf_ops.available():
        if quantization == "auto":
            log.info(
                "quantization auto: the blocks of %s run on the native kernels (gguf)", path.name
            )
        return "gguf"
    log.log(
        logging.WARNING if quantization == "gguf" else logging.INFO,
        "quantization %s: the native kernels are not available here (see the line above); "
        "the blocks of %s run on torch's int4/int8 kernels (auto)",
        quantization, path.name,
    )  # fmt: skip
    return "auto"
