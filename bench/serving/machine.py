"""The CPU a bench ran on, as /proc/cpuinfo tells it: model, cores, and the SIMD flags that decide
which kernels run (ours and llama.cpp's). Printed in every report, since a ratio between two servers
holds for one kind of CPU only.

`python -m bench.serving.machine` prints the block; `--cmake-args` prints the llama.cpp build flags
for this CPU (no -march=native, no AMX: see docs/PEERS.md).
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

# The flags that matter for int8 / int4 GEMMs, in the order a report lists them.
KERNEL_FLAGS = (
    "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
)  # fmt: skip


@dataclass(frozen=True)
class CpuInfo:
    model: str
    logical_cpus: int
    physical_cores: int
    flags: frozenset[str]

    @property
    def kernel_flags(self) -> list[str]:
        return [f for f in KERNEL_FLAGS if f in self.flags]

    def summary(self) -> dict[str, str]:
        """The lines a report prints."""
        return {
            "cpu": self.model,
            "cores": f"{self.physical_cores} physical, {self.logical_cpus} logical",
            "cpu_flags": " ".join(self.kernel_flags) or "(none of the SIMD flags we look for)",
        }


def parse_cpuinfo(text: str) -> CpuInfo:
    """/proc/cpuinfo's text -> CpuInfo (x86 layout; other layouts give an empty flag set)."""
    blocks = [b for b in text.strip().split("\n\n") if b.strip()]
    fields = [_fields(b) for b in blocks]
    first = fields[0] if fields else {}
    model = first.get("model name") or platform.processor() or platform.machine()
    cores = {(f.get("physical id", "0"), f.get("core id", str(i))) for i, f in enumerate(fields)}
    return CpuInfo(
        model=model,
        logical_cpus=len(fields) or os.cpu_count() or 1,
        physical_cores=len(cores) or 1,
        flags=frozenset((first.get("flags") or first.get("Features") or "").split()),
    )


def _fields(block: str) -> dict[str, str]:
    out = {}
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def cpu_info(path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
    try:
        return parse_cpuinfo(path.read_text())
    except OSError:
        n = os.cpu_count() or 1
        return CpuInfo(platform.processor() or platform.machine(), n, n, frozenset())


# llama.cpp's CMake switch for each flag it can compile for.
_GGML_SWITCHES = {
    "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
}  # fmt: skip


def llamacpp_cmake_args(info: CpuInfo) -> str:
    """CMAKE_ARGS for building llama-cpp-python for this CPU's flags without -march=native.

    AMX stays off: the native build of the pinned version crashed at its first decode on an
    AMX host (docs/PEERS.md), and the comparison is about the AVX2 / AVX512 paths anyway.
    """
    args = ["-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF"]
    args += [
        f"-D{switch}={'ON' if flag in info.flags else 'OFF'}"
        for flag, switch in _GGML_SWITCHES.items()
    ]
    args += [f"-DGGML_{amx}=OFF" for amx in ("AMX_TILE", "AMX_INT8", "AMX_BF16")]
    return " ".join(args)


def main(argv: list[str]) -> int:
    info = cpu_info()
    if argv == ["--cmake-args"]:
        print(llamacpp_cmake_args(info))
        return 0
    for key, value in info.summary().items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
