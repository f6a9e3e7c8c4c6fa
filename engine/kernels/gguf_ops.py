"""The GGUF block GEMM's Python face: typed calls into `torch.ops.specserve_kernels` and the
shapes torch.compile traces them with.

`mm(x, blocks, qtype)` multiplies float32 activation rows by a matrix held as the file's own
blocks (Q4_0, Q5_0, Q8_0, MXFP4, Q4_K, Q5_K, Q6_K); `dequantize` turns the blocks into float32.
`mm_bf16` is the prompt-chunk GEMM (csrc/prefill.cpp): panels of weight rows dequantized to bf16
in a cache-sized buffer and multiplied by torch's bf16 GEMM; `dequantize_bf16` the whole matrix. The C++
side picks its ISA variant from the running CPU; `variant` names one only for tests and benchmarks.
"""

from __future__ import annotations

from functools import cache

import torch

from engine.kernels import build

# GGML type ids (gguf.GGMLQuantizationType) -> (values, bytes) per block
FILE_FORMATS: dict[int, tuple[int, int]] = {
    2: (32, 18),
    6: (32, 22),
    8: (32, 34),
    39: (32, 17),  # MXFP4: an E8M0 scale and 16 bytes of 4-bit E2M1 codes (gpt-oss's experts)
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
Q4_K_X = 1012  # Q4_K repacked per row at load for the AVX512-VNNI tiles (never in a file)
Q4_K_R16 = 1013  # Q4_K / Q6_K with 16 rows interleaved at load (gguf_blocks.h; never in a file)
Q6_K_R16 = 1014
Q4_0_R16, Q5_0_R16, Q8_0_R16, MXFP4_R16 = 1015, 1016, 1017, 1018  # 32-value formats interleaved
FORMATS = {
    **FILE_FORMATS,
    Q4_K_X: (256, 148),
    Q4_K_R16: (256, 148),
    Q6_K_R16: (256, 210),
    Q4_0_R16: (32, 18),
    Q5_0_R16: (32, 22),
    Q8_0_R16: (32, 34),
    MXFP4_R16: (32, 17),
}


@cache
def available() -> bool:
    """True when the native library is loaded and offers the GGUF ops."""
    if not build.load():
        return False
    if "gguf_mm" not in build.ops():
        return False
    _register_fakes()
    return True


def variants() -> list[str]:
    """The ISA variants this CPU runs, best first, e.g. ["avx512vnni", "avx2", "scalar"]."""
    return list(torch.ops.specserve_kernels.gguf_variants()) if available() else []


def supports(qtype: int, in_features: int) -> bool:
    """Whether a file's matrix of this type and input width runs on the native kernels."""
    return qtype in FILE_FORMATS and in_features % FILE_FORMATS[qtype][0] == 0


def pack(
    blocks: torch.Tensor, qtype: int, variant: str = "", layout: str = ""
) -> tuple[torch.Tensor, int]:
    """The blocks in the layout the variant (default: the best here) runs fastest, and its type
    id: Q4_K and Q6_K get 16 rows interleaved for every SIMD variant (Q4_K_R16 +3% bytes,
    Q6_K_R16), Q4_0 / Q5_0 / Q8_0 / MXFP4 too (same bytes; Q8_0 not for plain AVX2); other types come
    back unchanged. `layout` "tiles" keeps the per-row layouts (Q4_K_X for
    AVX512-VNNI) and "rows16" asks for the interleaved ones: for tests and benchmarks."""
    if not available():
        raise RuntimeError("the native kernels are not available here")
    packed, packed_type = torch.ops.specserve_kernels.gguf_pack(blocks, qtype, variant, layout)
    return packed, int(packed_type)


def mm(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, variant: str = "", passes: int = 1
) -> torch.Tensor:
    """x [M, K] float32 times the blocks' matrix [N, K] transposed: [M, N] float32. The
    activations are rounded to int8 once, or (passes=2) again for what the first rounding left."""
    out: torch.Tensor = torch.ops.specserve_kernels.gguf_mm(x, blocks, qtype, variant, passes)
    return out


def dequantize(blocks: torch.Tensor, qtype: int) -> torch.Tensor:  # [N, bytes] -> [N, K] float32
    out: torch.Tensor = torch.ops.specserve_kernels.gguf_dequantize(blocks, qtype)
    return out


# Bytes of one thread's bf16 weight panel in mm_bf16, about a recent Xeon's L2 (2 MiB a core):
# smaller panels cost more per GEMM call than they save (measured in docs/KERNELS.md).
PANEL_BYTES = 2 * 1024 * 1024


def panel_rows(in_features: int) -> int:
    """Weight rows per panel for mm_bf16: a power of two in [32, 256], about PANEL_BYTES."""
    rows = 32
    while rows < 256 and (2 * rows) * in_features * 2 <= PANEL_BYTES:
        rows *= 2
    return rows


@cache
def has_prefill_ops() -> bool:
    """Whether the loaded library offers the bf16 prefill ops (csrc/prefill.cpp). Probed once:
    listing the registered ops walks every torch schema (~19 ms), and the dense path asks on
    every call."""
    return available() and "gguf_mm_bf16" in build.ops()


def mm_bf16(x: torch.Tensor, blocks: torch.Tensor, qtype: int, isa: str = "") -> torch.Tensor:
    """x [M, K] bf16 times the blocks' matrix [N, K] transposed: [M, N] bf16, no [N, K] copy."""
    rows = panel_rows(x.shape[1])
    out: torch.Tensor = torch.ops.specserve_kernels.gguf_mm_bf16(x, blocks, qtype, rows, isa)
    return out


def dequantize_bf16(blocks: torch.Tensor, qtype: int, isa: str = "") -> torch.Tensor:
    """[N, bytes] -> [N, K] bf16, rounded to nearest even as torch's `.to(torch.bfloat16)`."""
    out: torch.Tensor = torch.ops.specserve_kernels.gguf_dequantize_bf16(blocks, qtype, isa)
    return out


def row_bytes(qtype: int, in_features: int) -> int:
    values, nbytes = FORMATS[qtype]
    return in_features // values * nbytes


@cache
def _register_fakes() -> None:
    @torch.library.register_fake("specserve_kernels::gguf_mm")  # type: ignore[untyped-decorator]
    def _(
        x: torch.Tensor, blocks: torch.Tensor, qtype: int, variant: str = "", passes: int = 1
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("specserve_kernels::gguf_dequantize")  # type: ignore[untyped-decorator]
    def _(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
        values, nbytes = FORMATS[qtype]
        k = blocks.shape[1] // nbytes * values
        return blocks.new_empty(blocks.shape[0], k, dtype=torch.float32)

    if "gguf_mm_bf16" not in build.ops():
        return

    @torch.library.register_fake("specserve_kernels::gguf_mm_bf16")  # type: ignore[untyped-decorator]
    def _(
        x: torch.Tensor, blocks: torch.Tensor, qtype: int, panel_rows: int, isa: str = ""
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("specserve_kernels::gguf_dequantize_bf16")  # type: ignore[untyped-decorator]
    def _(blocks: torch.Tensor, qtype: int, isa: str = "") -> torch.Tensor:
        values, nbytes = FORMATS[qtype]
        k = blocks.shape[1] // nbytes * values
        return blocks.new_empty(blocks.shape[0], k, dtype=torch.bfloat16)
