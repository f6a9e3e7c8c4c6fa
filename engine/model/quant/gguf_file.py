"""A minimal GGUF reader: the metadata's scalars and short arrays, and the tensors.

gguf.GGUFReader parses every metadata item into numpy views (the 151,936-token vocabulary and
merges of a Qwen file take it ~25 s); the weights need only the tensor table, so this reads the
header with `struct` and maps the data with numpy. Layout (GGUF v2/v3, little-endian): magic,
version, tensor count, metadata count; metadata as (key, type, value); tensor infos as (name,
dims innermost first, type, offset); data at the next multiple of `general.alignment` (32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_ARRAY_KEPT = 1024  # longer arrays (a vocabulary, its merges) are skipped: nothing here reads them


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # [rows, bytes per row] uint8 for quantized types, [rows, cols] for floats
    offset: int  # of the data in the file


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value  # type: ignore[no-any-return]

    def string(self) -> str:
        n = int(self.scalar("Q"))
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> object:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = int(self.scalar("I")), int(self.scalar("Q"))
            if item in _SCALARS and count > _ARRAY_KEPT:
                self.pos += struct.calcsize(_SCALARS[item]) * count
                return None
            items = [self.value(item) for _ in range(count)]
            return items if count <= _ARRAY_KEPT else None
        return self.scalar(_SCALARS[kind])


def _metadata(cur: _Cursor) -> tuple[int, dict[str, object]]:
    """(tensor count, metadata) from the start of the file; the cursor left past them."""
    if cur.scalar("I") != 0x46554747:  # b"GGUF"
        raise ValueError("not a GGUF file")
    cur.scalar("I")  # version
    num_tensors, num_kv = int(cur.scalar("Q")), int(cur.scalar("Q"))
    meta: dict[str, object] = {}
    for _ in range(num_kv):
        key = cur.string()
        meta[key] = cur.value(int(cur.scalar("I")))
    return num_tensors, meta


def read_gguf_metadata(path: Path) -> dict[str, object]:
    """Every metadata key: scalars, strings and arrays of up to 1,024 items (longer ones None)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        return _metadata(_Cursor(mapped.data))[1]
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def read_gguf(path: Path) -> tuple[str, list[GgufTensorInfo]]:
    """(general.architecture, the tensors in file order, their data memory-mapped)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(mapped.data)
    try:
        num_tensors, meta = _metadata(cur)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [int(cur.scalar("Q")) for _ in range(int(cur.scalar("I")))]
        infos.append((name, dims, int(cur.scalar("I")), int(cur.scalar("Q"))))
    align = int(meta.get("general.alignment") or 32)  # type: ignore[call-overload]
    start = -(-cur.pos // align) * align
    tensors = [_tensor(mapped, start, info) for info in infos]
    return str(meta["general.architecture"]), tensors


def _tensor(
    mapped: np.ndarray, start: int, info: tuple[str, list[int], int, int]
) -> GgufTensorInfo:
    name, dims, kind, offset = info
    qtype = gguf.GGMLQuantizationType(kind)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    cols = dims[0]
    rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
    row_bytes = cols // block * type_size
    raw = mapped[start + offset : start + offset + rows * row_bytes].reshape(rows, row_bytes)
    floats = {"F32": np.float32, "F16": np.float16}
    data: np.ndarray
    if qtype.name in floats:
        data = raw.view(floats[qtype.name])
        data = data.reshape(rows, cols) if len(dims) > 1 else data.reshape(cols)
    else:
        data = raw
    return GgufTensorInfo(name, qtype, data, start + offset)
