"""The fused small ops' Python face (engine/kernels/csrc/fused.cpp): typed calls, the eager
reference each one must match, and the shapes torch.compile traces them with.

`add_rmsnorm` and `rmsnorm` are a decoder's RMSNorm (with the residual add before it), `silu_mul`
its SwiGLU activation. Each takes `out_dtype` float32 to hand a float32 GEMM (the GGUF kernels)
its input without a separate cast; the values are the model dtype's either way.
`SPECSERVE_FUSED_OPS=0` turns them off (the eager references run instead).
"""

from __future__ import annotations

import os
from functools import cache

import torch
import torch.nn.functional as F

from engine.kernels import build

_DTYPES = (torch.float32, torch.bfloat16)
# read once; benchmarks flip it to compare fused and eager in one process
ENABLED = os.environ.get("SPECSERVE_FUSED_OPS", "1") not in ("0", "false", "off")


@cache
def loaded() -> bool:
    """The native library is loaded and offers the fused ops (probed once)."""
    if not build.load() or "silu_mul" not in build.ops():
        return False
    _register_fakes()
    return True


def usable(x: torch.Tensor) -> bool:
    """Whether the native op runs for activations like x (else the reference does)."""
    return ENABLED and x.device.type == "cpu" and x.dtype in _DTYPES and loaded()


def rmsnorm(
    x: torch.Tensor,  # [M, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    out_dtype: torch.dtype,
    isa: str = "auto",  # "scalar", "avx2", "avx512" pin a variant (tests)
) -> torch.Tensor:  # [M, H] out_dtype
    out: torch.Tensor = torch.ops.specserve_kernels.rmsnorm(
        x.contiguous(), weight, eps, out_dtype, isa
    )
    return out


def add_rmsnorm(
    x: torch.Tensor,  # [M, H]: residual's dtype, or float32 not yet rounded to it
    residual: torch.Tensor,  # [M, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    out_dtype: torch.dtype,
    isa: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual) [M, H] out_dtype, x + residual
    """x + residual in residual's dtype (x rounded to it first), and its norm."""
    out, total = torch.ops.specserve_kernels.add_rmsnorm(
        x.contiguous(), residual.contiguous(), weight, eps, out_dtype, isa
    )
    return out, total


def silu_mul(
    gate_up: torch.Tensor,  # [M, 2I]: float32, or dtype
    dtype: torch.dtype,  # the model's: where the eager ops round
    out_dtype: torch.dtype,
    isa: str = "auto",
) -> torch.Tensor:  # [M, I] out_dtype
    out: torch.Tensor = torch.ops.specserve_kernels.silu_mul(
        gate_up.contiguous(), dtype, out_dtype, isa
    )
    return out


def rope_write_kv(
    qk: torch.Tensor,  # [T, heads + kv_heads, D]: each token's heads contiguous
    v: torch.Tensor,  # [T, kv_heads, D]
    cos: torch.Tensor,  # [T, 1, D]
    signed_sin: torch.Tensor,  # [T, 1, D]: sin with its first half negated
    k_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, D]
    v_cache: torch.Tensor,  # [kv_heads, num_blocks, block_size, D]
    slot_mapping: torch.Tensor,  # [T] int64
    heads: int,
) -> torch.Tensor:  # [T, heads, D]: the rotated queries
    """The rotary embedding of queries and keys, and the rotated keys and the values written to
    their cache slots, in one pass (decoder.apply_rope + attention.write_kv, same roundings)."""
    q: torch.Tensor = torch.ops.specserve_kernels.rope_write_kv(
        qk, v, cos, signed_sin, k_cache, v_cache, slot_mapping, heads
    )
    return q


def rope_kv_usable(qk: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The native op runs for this layer: qk on the CPU in a fused dtype, the cache in qk's
    dtype (on qk's device, as every layer's cache is), and no graph being traced."""
    return usable(qk) and qk.dtype == k_cache.dtype and not torch.compiler.is_compiling()


# ---------------------------------------------------------------------------- references


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype
) -> torch.Tensor:  # the eager decoder's RMSNorm: [M, H] -> [M, H] out_dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype)).to(out_dtype)


def silu_mul_reference(
    gate_up: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:  # the eager decoder's SwiGLU: [M, 2I] -> [M, I] out_dtype
    gate, up = gate_up.to(dtype).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(out_dtype)


@cache
def _register_fakes() -> None:
    @torch.library.register_fake("specserve_kernels::rmsnorm")  # type: ignore[untyped-decorator]
    def _(
        x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, isa: str = ""
    ) -> torch.Tensor:
        return x.new_empty(x.shape, dtype=out_dtype)

    @torch.library.register_fake("specserve_kernels::add_rmsnorm")  # type: ignore[untyped-decorator]
    def _(
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        isa: str = "",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x.new_empty(x.shape, dtype=out_dtype), torch.empty_like(residual)

    @torch.library.register_fake("specserve_kernels::rope_write_kv")  # type: ignore[untyped-decorator]
    def _(
        qk: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        heads: int,
    ) -> torch.Tensor:
        return qk.new_empty(qk.shape[0], heads, qk.shape[2])

    @torch.library.register_fake("specserve_kernels::silu_mul")  # type: ignore[untyped-decorator]
    def _(
        gate_up: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype, isa: str = ""
    ) -> torch.Tensor:
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=out_dtype)
