"""A lower bound on the memory a model's weights take once loaded, read from
the headers of its safetensors files (no tensor data is read).

Used to refuse, before any weights load, a cap that cannot possibly fit next
to them. Every estimate here errs low: a start that would work is never
refused because of it. No vLLM import.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

_FLOAT_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_SIZES = {
    **_FLOAT_SIZES,
    "I64": 8,
    "U64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER_BYTES = 100 * 2**20


def header_tensors(path: Path) -> dict[str, dict]:
    """The tensor entries of one safetensors file's JSON header."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header of {length} bytes is not a safetensors header")
        header = json.loads(handle.read(length))
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def tensor_bytes(entry: dict, load_itemsize: int | None) -> int:
    """Bytes of one tensor once loaded: floating-point tensors at the smaller
    of their stored and the load dtype's size, others as stored."""
    count = 1
    for dim in entry.get("shape", []):
        count *= int(dim)
    dtype = entry.get("dtype", "")
    if dtype in _FLOAT_SIZES and load_itemsize:
        return count * min(_FLOAT_SIZES[dtype], load_itemsize)
    if dtype in _SIZES:
        return count * _SIZES[dtype]
    start, end = entry.get("data_offsets", (0, 0))
    return int(end) - int(start)


def weight_files(folder: Path) -> list[list[Path]]:
    """Sets of safetensors files that each hold the whole model: the files
    named in ``model.safetensors.index.json`` if there is one, else each file
    on its own (a folder may hold the same weights twice, e.g. a consolidated
    copy, so without an index only one file is surely loaded)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [[folder / name for name in names]]
    files = sorted(folder.glob("*.safetensors"))
    return [files] if len(files) == 1 else [[f] for f in files]


def weight_bytes_lower_bound(folder: str | os.PathLike[str], load_itemsize: int | None) -> int:
    """A lower bound on the bytes of weights loaded from ``folder`` at
    ``load_itemsize`` bytes per floating-point element; 0 when the folder
    holds no readable safetensors files."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    bounds = []
    for files in weight_files(folder):
        total = 0
        for path in files:
            try:
                tensors = header_tensors(path)
            except (OSError, ValueError, struct.error):
                total = 0
                break
            total += sum(tensor_bytes(entry, load_itemsize) for entry in tensors.values())
        bounds.append(total)
    return min(bounds) if bounds else 0
