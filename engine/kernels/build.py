"""Build and load the native kernels: every `csrc/*.cpp` compiled into one torch extension.

One shared library, `specserve_kernels`, registers its ops with `TORCH_LIBRARY_FRAGMENT(specserve_kernels, m)`
(one fragment per source file), so `torch.ops.specserve_kernels.<op>` is how Python calls them. The
library is built for the baseline x86-64 ISA; each kernel picks its AVX2 / AVX512 / VNNI variant at
run time from what the CPU reports (`__builtin_cpu_supports`), never from the build machine.

The build is cached under `~/.cache/specserve/kernels/<key>` (the key hashes the sources, the flags
and torch's version), so `make install` builds once and a server start only loads. Without a
compiler, or when the build fails, `load()` returns False after one log line and the model layers
keep torch's own kernels. `SPECSERVE_NATIVE_KERNELS=0` turns the native kernels off.

    python -m engine.kernels.build      # build (or find) the library and print what it offers
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from functools import cache
from pathlib import Path

import torch
from filelock import FileLock

log = logging.getLogger(__name__)

NAME = "specserve_kernels"
CSRC = Path(__file__).parent / "csrc"
CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function")
LDFLAGS = ("-fopenmp",)


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def build_key() -> str:
    digest = hashlib.sha256()
    for path in sorted([*sources(), *CSRC.glob("*.h")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    return f"{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:12]}"


def build_dir() -> Path:
    root = (
        os.environ.get("SPECSERVE_KERNELS_CACHE")
        or Path.home() / ".cache" / "specserve" / "kernels"
    )
    path = Path(root) / build_key()
    path.mkdir(parents=True, exist_ok=True)
    return path


def enabled() -> bool:
    return os.environ.get("SPECSERVE_NATIVE_KERNELS", "1") not in ("0", "false", "off")


@cache
def load(verbose: bool = False) -> bool:
    """Build (once) and load the library; True when `torch.ops.specserve_kernels` is ready."""
    if not enabled() or not sources():
        return False
    from torch.utils import cpp_extension

    started = time.perf_counter()
    directory = build_dir()
    try:
        # One builder at a time, by an OS lock that dies with its process: torch's own `lock`
        # file outlives a killed build and would make every later load wait forever.
        with FileLock(str(directory / "specserve-build.lock")):
            (directory / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=NAME,
                sources=[str(path) for path in sources()],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                is_python_module=False,
                verbose=verbose,
            )
    except Exception as error:  # no compiler, no ninja, a build error: torch's kernels serve
        first_line = (str(error).splitlines() or [type(error).__name__])[0][:200]
        log.warning("native kernels unavailable, using torch's (%s)", first_line)
        return False
    log.info("native kernels loaded in %.1f s from %s", time.perf_counter() - started, directory)
    return True


def ops() -> list[str]:
    """The op names the loaded library registered, e.g. ["cpu_supports", ...]."""
    prefix = f"{NAME}::"
    names = {schema.name for schema in torch._C._jit_get_all_schemas()}
    return sorted(name.removeprefix(prefix) for name in names if name.startswith(prefix))


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(f"building {NAME} from {len(sources())} source(s) in {build_dir()} ...", flush=True)
    if not load(verbose="-v" in sys.argv):
        print("native kernels: not built; the server will use torch's kernels")
        return 0
    print(f"native kernels: ready ({', '.join(ops()) or 'no ops'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
