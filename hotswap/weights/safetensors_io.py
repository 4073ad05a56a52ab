"""Reading safetensors checkpoint folders without intermediate copies.

Headers are parsed directly (8-byte length, JSON), so names, dtypes and shapes are known before any data is
read. Tensors are views of a private memory map of the file: loading copies each straight from the page cache
into the parameter. A file shorter than its header promises is reported as truncated before any data moves.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def safetensors_files(folder: str) -> list[str]:
    """The *.safetensors files of a checkpoint folder, sorted; `folder` is a literal path (no pattern). Raises
    ValueError if it is not a folder, holds none, or one is not a regular file (a FIFO or device would block or
    stream forever)."""
    if not os.path.isdir(folder):
        raise ValueError(f"{folder!r} is not a checkpoint folder")
    with os.scandir(folder) as entries:  # hidden files (e.g. "._x.safetensors" resource forks) are not weights
        files = sorted(e.path for e in entries if e.name.endswith(".safetensors") and not e.name.startswith("."))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder!r}")
    try:
        special = [path for path in files if not stat.S_ISREG(os.stat(path).st_mode)]
    except OSError as err:  # e.g. a broken symlink
        raise ValueError(f"cannot read checkpoint file {err.filename!r}: {err.strerror}") from None
    if special:
        raise ValueError(f"not regular files (refused): {special}")
    return files


def read_index(folder: str) -> dict[str, TensorEntry]:
    """Name -> entry for every tensor of the folder, from the headers alone. Raises ValueError for a malformed
    or truncated file, an unsupported dtype, or a name that appears in two files."""
    index: dict[str, TensorEntry] = {}
    for path in safetensors_files(folder):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{path!r} is truncated (no safetensors header)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > size - 8:
                raise ValueError(f"{path!r} is truncated (header of {header_len} bytes in a {size}-byte file)")
            try:
                header = json.loads(f.read(header_len))
            except ValueError as err:
                raise ValueError(f"{path!r} has a malformed safetensors header: {err}") from None
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path!r}: tensor {name!r} has unsupported dtype {info['dtype']}")
            start, end = (base + int(x) for x in info["data_offsets"])
            dtype, shape = _DTYPES[info["dtype"]], tuple(info["shape"])
            if start < base or end - start != torch.Size(shape).numel() * dtype.itemsize:
                raise ValueError(
                    f"{path!r}: tensor {name!r} has data_offsets {info['data_offsets']} that do not match its "
                    f"dtype and shape {shape}"
                )
            if end > size:
                raise ValueError(f"{path!r} is truncated: tensor {name!r} ends at byte {end} of {size}")
            if name in index:
                raise ValueError(f"duplicate tensor {name!r}: it appears in more than one file of {folder!r}")
            index[name] = TensorEntry(path, dtype, shape, start, end)
    return index


def declared(index: dict[str, TensorEntry]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of an index: what a load declares before data moves."""
    return [(name, entry.dtype, entry.shape) for name, entry in index.items()]


def iterate_index(index: dict[str, TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor view) in file order; views are valid until the next item is requested."""
    by_file: dict[str, list[tuple[str, TensorEntry]]] = {}
    for name, entry in index.items():
        by_file.setdefault(entry.file, []).append((name, entry))
    for path, entries in by_file.items():
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            for name, entry in sorted(entries, key=lambda item: item[1].start):
                count = torch.Size(entry.shape).numel()
                if count == 0:
                    yield name, torch.empty(entry.shape, dtype=entry.dtype)
                    continue
                tensor = torch.frombuffer(mapped, dtype=entry.dtype, count=count, offset=entry.start)
                yield name, tensor.view(entry.shape)
                del tensor
        finally:
            try:
                mapped.close()
            except BufferError:  # a view is still referenced by the consumer; unmapped when collected
                pass


def iterate_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of the checkpoint folder."""
    yield from iterate_index(read_index(folder))
