"""Plain-file safetensors reading and writing, one tensor at a time.

``safetensors.safe_open`` memory-maps the whole file, and every page touched stays in the process's
RSS until the map is closed; ``save_file`` needs every tensor of a shard in memory at once. The
streaming engine instead parses headers itself (checked with the library's own rules: ``validate``), reads each tensor with ``readinto`` into a buffer it
owns, and writes a shard's header first (every size is known from the plan), then tensor bytes at
their offsets.

Byte layout rules are taken from safetensors itself rather than re-stated here: the dtype names and
the order of tensors inside a file (descending dtype, then name) are learnt once by serialising
empty tensors with ``safetensors.torch.save`` and reading the header back.
"""

from __future__ import annotations

import io
import json
import os
import struct
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from publisher.errors import InputError, QuantizeError
from publisher.io.localfiles import open_regular
from publisher.streaming import validate
from publisher.streaming.validate import HeaderEntry

if TYPE_CHECKING:
    import torch

# Never hold more than this many bytes of a pass-through tensor at once (embeddings can be GBs).
CHUNK_BYTES = 64 * 1024 * 1024


def read_header(path: Path | BinaryIO, name: str | None = None) -> tuple[dict[str, str], dict[str, HeaderEntry]]:
    """Parse and validate a safetensors header without mapping the file: (``__metadata__``, tensors by name).

    ``path`` may also be an open binary file (e.g. a Hub file read by HTTP range); ``name`` names it in errors.
    The header must pass every rule of ``validate`` (the safetensors library's own), else ``InputError``."""
    if isinstance(path, (str, Path)):
        with open_regular(Path(path)) as local:
            return read_header(local, name or str(path))
    f = path
    name = name or str(getattr(f, "name", None) or "safetensors file")
    f.seek(0)
    prefix = f.read(8)
    size = file_size(f, name)
    n = validate.header_length(prefix, size, name)
    raw = f.read(n)
    if len(raw) != n:
        raise InputError(f"{name} ended after {8 + len(raw)} of its {size} bytes while its header was read "
                         "(truncated, or changed while being read); fetch it again", kind="length")
    return validate.parse_header(raw, size, name)


def file_size(f: BinaryIO, name: str) -> int:
    """The size of an open file: from the file system, or what a ``RangeFile`` learnt from the server."""
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, io.UnsupportedOperation):
        pass
    size = getattr(f, "size", None)
    if isinstance(size, int):
        return size
    raise InputError(f"the size of {name} is unknown, so its header cannot be checked", kind="length")


@cache
def _layout(dtypes: tuple[Any, ...]) -> tuple[dict[Any, str], dict[Any, int]]:
    """safetensors' name and sort rank for each torch dtype, learnt from safetensors itself."""
    import torch
    from safetensors.torch import save

    probe = {str(i): torch.empty(0, dtype=d) for i, d in enumerate(dtypes)}
    blob = save(probe)
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    names = {dtypes[int(k)]: v["dtype"] for k, v in header.items()}
    # json.loads keeps the file order, which is safetensors' sort order (distinct dtypes, so the
    # numeric names never decide it).
    rank = {dtypes[int(k)]: i for i, k in enumerate(header)}
    return names, rank


def dtype_name(dtype: torch.dtype) -> str:
    return _layout((dtype,))[0][dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a safetensors dtype name (the inverse of what ``save`` writes).

    Every byte-sized dtype the library accepts has one; the sub-byte ones (F4, F6_*) are packed in ways a plain
    read cannot rebuild, and are refused with the fix."""
    import torch
    from safetensors.torch import _TYPES  # the table safetensors' own loader uses

    extra = {"F8_E8M0": getattr(torch, "float8_e8m0fnu", None)}  # known to the library, missing from that table
    dtype = _TYPES.get(name) or extra.get(name)
    if dtype is None:
        raise QuantizeError(f"the checkpoint holds {name} tensors, which the streaming engine does not read; "
                            "use --engine library")
    return dtype


def order_entries(entries: list[tuple[str, torch.dtype]]) -> list[int]:
    """Indices of ``entries`` (name, dtype) in the order safetensors lays them out in a file."""
    dtypes = tuple(dict.fromkeys(d for _, d in entries))
    _, rank = _layout(dtypes)
    return sorted(range(len(entries)), key=lambda i: (rank[entries[i][1]], entries[i][0]))


def encode_header(metadata: dict[str, str], tensors: list[tuple[str, str, tuple[int, ...], int, int]]) -> bytes:
    """The header bytes (length prefix included) exactly as safetensors' serde writer produces them.

    ``tensors``: (name, dtype name, shape, begin, end) in file order, offsets relative to the data.
    safetensors keeps ``__metadata__`` in a Rust HashMap, so its own key order changes from run to
    run; we write the keys in the order given (the order the libraries build the dict in).
    """
    def s(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)

    parts = ['"__metadata__":{' + ",".join(f"{s(k)}:{s(v)}" for k, v in metadata.items()) + "}"]
    for name, dtype, shape, begin, end in tensors:
        shape_s = ",".join(str(d) for d in shape)
        parts.append(f'{s(name)}:{{"dtype":"{dtype}","shape":[{shape_s}],"data_offsets":[{begin},{end}]}}')
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    body += b" " * ((8 - len(body) % 8) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(body)) + body


def read_tensor(f: BinaryIO, entry: HeaderEntry) -> torch.Tensor:
    """Read one tensor into its own buffer (plain ``readinto``, no mapping)."""
    import torch

    buf = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
    f.seek(entry.begin)
    _readinto(f, buf)
    dtype = torch_dtype(entry.dtype)
    if buf.numel() == 0:
        return torch.empty(entry.shape, dtype=dtype)
    return buf.view(dtype).reshape(entry.shape)


def read_rows(f: BinaryIO, entry: HeaderEntry, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a tensor (its first dimension): a contiguous byte range of the file, read alone."""
    import torch

    rows = entry.shape[0]
    if not 0 <= start <= stop <= rows:
        raise IndexError(f"rows {start}:{stop} of a tensor of {rows}")
    row_bytes = (entry.end - entry.begin) // max(rows, 1)
    buf = torch.empty((stop - start) * row_bytes, dtype=torch.uint8)
    f.seek(entry.begin + start * row_bytes)
    _readinto(f, buf)
    return buf.view(torch_dtype(entry.dtype)).reshape(stop - start, *entry.shape[1:])


def read_bytes(f: BinaryIO, offset: int, n: int) -> torch.Tensor:
    """``n`` raw bytes at ``offset`` into a buffer of their own (a chunk of a large tensor)."""
    import torch

    buf = torch.empty(n, dtype=torch.uint8)
    f.seek(offset)
    _readinto(f, buf)
    return buf


def chunk_step(entry: HeaderEntry) -> int:
    """Bytes per chunk of a large pass-through tensor: whole elements, at most ``CHUNK_BYTES``."""
    size = torch_dtype(entry.dtype).itemsize
    return max(size, CHUNK_BYTES // size * size)


def _readinto(f: Any, buf: torch.Tensor) -> None:  # a file or RangeFile: anything with readinto
    view = memoryview(buf.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise EOFError(f"{getattr(f, 'name', 'safetensors file')} ended early (truncated download?)")
        done += n


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor's data (contiguous, little-endian)."""
    import torch

    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
