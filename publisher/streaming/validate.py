"""The safetensors header rules, as the safetensors library applies them (0.8: ``SafeTensors::read_metadata``).

Every safetensors file this tool reads (a base shard on disk or by HTTP range, our own output read back, a
verify target) is checked here first, so the streaming engine never quantizes bytes that the library path
would have refused. The rules, in the library's order; the first that fails names the error's ``kind``:

1. ``too_small``: the file is shorter than the 8-byte little-endian header length.
2. ``too_large``: the header length is over 100,000,000 bytes (the library's ``MAX_HEADER_SIZE``).
3. ``length``: the header runs past the end of the file.
4. ``utf8``: the header is not UTF-8.
5. ``json``: the header is not what the library deserialises: strict JSON (no NaN, no number beyond the double
   range, no unpaired surrogate escape, nesting under 128 levels), an object whose ``__metadata__`` (at most
   once; may be null) maps strings to strings, and whose every other member is a tensor: an object with
   ``dtype`` (a name of ``DTYPE_BITS``), ``shape`` (a list of integers 0..2**64-1) and ``data_offsets`` (two
   such integers), each given once (other members are ignored), or those three as a 3-element list.
6. Per tensor, in order of ``data_offsets``: ``offsets`` (it starts where the previous one ended and does not
   end before it begins: no gap, no overlap), ``overflow`` (elements x bits fits in 64 bits), ``misaligned``
   (a sub-byte dtype ends on a byte), ``size`` (end - begin = elements x bits / 8).
7. ``coverage``: the tensors cover the data section exactly, to the last byte of the file.
8. ``duplicate``, ours only: the library keeps the last of two equal tensor names (or ``__metadata__`` keys)
   without a word; we refuse them, since a reader that keeps the first would see another file.

tests/test_safetensors_validator.py holds this to the installed library with generated files (Hypothesis).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from publisher.errors import InputError

MAX_HEADER_BYTES = 100_000_000
# Every dtype the library knows, with its size in bits (safetensors/src/tensor.rs, ``Dtype::bitsize``).
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
_USIZE_MAX = 2**64 - 1
_MAX_DEPTH = 127  # serde_json's recursion limit: the 128th nested array or object is refused
_FIELDS = ("dtype", "shape", "data_offsets")
_SURROGATE = re.compile("[\ud800-\udfff]")  # Python's json lets "\ud800" through; serde_json does not


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as an input safetensors header describes it."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte


class _Obj(dict[str, Any]):
    """A JSON object that keeps every (key, value) it was given, in order, duplicates included."""

    pairs: list[tuple[str, Any]]


def _object(pairs: list[tuple[str, Any]]) -> _Obj:
    obj = _Obj(pairs)  # the last of equal keys wins, as in serde's maps
    obj.pairs = pairs
    return obj


class _Reject(Exception):
    """A JSON token serde_json refuses and Python's json accepts."""


def _int(text: str) -> int | float:
    if math.isinf(float(text)):  # serde_json reads integers past u64/i64 as doubles
        raise _Reject(f"number out of range: {text[:20]}...")
    return -0.0 if text == "-0" else int(text)  # serde_json reads "-0" as a double, so it is no usize


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Reject(f"number out of range: {text[:20]}")
    return value


def _constant(text: str) -> Any:
    raise _Reject(f"{text} is not JSON")


def _bad(name: str, kind: str, detail: str) -> InputError:
    why = ("the safetensors library would silently keep the last one" if kind == "duplicate"
           else "the safetensors library refuses it too")
    return InputError(f"{name} is not a valid safetensors file: {detail} ({why}); fix or re-upload the file", kind=kind)


def header_length(prefix: bytes, file_size: int, name: str) -> int:
    """Rules 1-3: the header length from the first 8 bytes of a file of ``file_size`` bytes."""
    if file_size < 8 or len(prefix) < 8:
        raise _bad(name, "too_small", f"it is {file_size} bytes long, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise _bad(name, "too_large", f"its header length {n} is over the limit of {MAX_HEADER_BYTES:,} bytes")
    if 8 + n > file_size:
        raise _bad(name, "length", f"its header length {n} points past the end of the file ({file_size} bytes)")
    return n


def parse_header(raw: bytes, file_size: int, name: str) -> tuple[dict[str, str], dict[str, HeaderEntry]]:
    """Rules 4-8 on the header bytes ``raw`` (the ``header_length`` bytes after the prefix) of a file of
    ``file_size`` bytes: (``__metadata__``, tensors by name, absolute offsets)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(name, "utf8", f"its header is not UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise _bad(name, "json", f"its header is not JSON ({exc.msg} at character {exc.pos})") from None
    except (_Reject, ValueError, RecursionError) as exc:
        raise _bad(name, "json", f"its header is not JSON ({exc or type(exc).__name__})") from None
    metadata, tensors, dups = _typed(doc, name)
    base = 8 + len(raw)
    end = _check_offsets(tensors, name)
    if base + end != file_size:
        have = file_size - base
        detail = (f"its tensors cover {end} bytes of data but the file holds {have}: "
                  + ("the file is truncated" if have < end else f"{have - end} bytes belong to no tensor"))
        raise _bad(name, "coverage", detail)
    if dups:
        raise _bad(name, "duplicate", f"{dups[0]!r} is given twice in the header")
    entries = {t: HeaderEntry(t, d, tuple(shape), base + s, base + e) for t, (d, shape, s, e) in tensors.items()}
    return metadata, entries


_Tensor = tuple[str, list[int], int, int]  # dtype, shape, begin, end (relative to the data section)


def _typed(doc: Any, name: str) -> tuple[dict[str, str], dict[str, _Tensor], list[str]]:
    """Rule 5: the header as serde deserialises it (every value given, including the earlier of two equal keys, is
    type-checked, as serde does). Returns metadata, tensors (the last of equal names) and the duplicated names."""
    def fail(detail: str) -> InputError:
        return _bad(name, "json", detail)

    if not isinstance(doc, _Obj):
        raise fail(f"its header is {_what(doc)}, not a JSON object")
    _walk(doc, fail)
    metadata: dict[str, str] = {}
    tensors: dict[str, _Tensor] = {}
    dups: list[str] = []
    seen_metadata = False
    for key, value in doc.pairs:
        if key == "__metadata__":
            if seen_metadata:
                raise fail("__metadata__ is given twice")
            seen_metadata = True
            if value is None:
                continue
            if not isinstance(value, _Obj):
                raise fail(f"__metadata__ is {_what(value)}, not an object of strings")
            for mkey, mvalue in value.pairs:
                if not isinstance(mvalue, str):
                    raise fail(f"__metadata__ value of {mkey!r} is {_what(mvalue)}, not a string")
                if mkey in metadata:
                    dups.append(f"__metadata__ key {mkey}")
                metadata[mkey] = mvalue
            continue
        if key in tensors:
            dups.append(key)
        tensors[key] = _tensor(key, value, fail)
    return metadata, tensors, dups


def _tensor(key: str, info: Any, fail: Callable[[str], Exception]) -> _Tensor:
    if isinstance(info, _Obj):
        fields: dict[str, Any] = {}
        for field, value in info.pairs:
            if field in _FIELDS:
                if field in fields:
                    raise fail(f"tensor {key!r} gives {field} twice")
                fields[field] = value
        missing = [f for f in _FIELDS if f not in fields]
        if missing:
            raise fail(f"tensor {key!r} has no {missing[0]}")
        dtype, shape, offsets = (fields[f] for f in _FIELDS)
    elif isinstance(info, list):
        if len(info) != 3:
            raise fail(f"tensor {key!r} is a list of {len(info)} values, not (dtype, shape, data_offsets)")
        dtype, shape, offsets = info
    else:
        raise fail(f"tensor {key!r} is {_what(info)}, not an object")
    if isinstance(dtype, _Obj):  # serde also reads an enum from {"NAME": null}
        if len(dtype.pairs) != 1 or dtype.pairs[0][1] is not None:
            raise fail(f"tensor {key!r} has an unknown dtype {dict(dtype.pairs)!r}")
        dtype = dtype.pairs[0][0]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise fail(f"tensor {key!r} has an unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_usize(d) for d in shape):
        raise fail(f"tensor {key!r} has the shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_usize(o) for o in offsets):
        raise fail(f"tensor {key!r} has data_offsets {offsets!r}, not two non-negative integers")
    return dtype, shape, offsets[0], offsets[1]


def _usize(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _USIZE_MAX


def _walk(doc: _Obj, fail: Callable[[str], Exception]) -> None:
    """serde_json's limits that Python's json does not have: nesting depth and unpaired surrogates."""
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise fail("its header holds an unpaired UTF-16 surrogate escape")
        elif isinstance(value, (_Obj, list)):
            if depth > _MAX_DEPTH:
                raise fail(f"its header nests deeper than {_MAX_DEPTH} levels")
            children = value.pairs if isinstance(value, _Obj) else [(None, v) for v in value]
            for key, child in children:
                if key is not None and _SURROGATE.search(key):
                    raise fail("its header holds an unpaired UTF-16 surrogate escape")
                stack.append((child, depth + 1))


def _check_offsets(tensors: dict[str, _Tensor], name: str) -> int:
    """Rule 6, tensor by tensor in order of data_offsets (the library's order); returns where the data ends."""
    start = 0
    for key, (dtype, shape, begin, end) in sorted(tensors.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin != start or end < begin:
            where = f"data_offsets [{begin}, {end}]"
            detail = (f"tensor {key!r} ends before it begins ({where})" if end < begin
                      else f"tensor {key!r} starts at byte {begin} ({where}) but the previous tensor ends at byte {start}: "
                      + ("a gap" if begin > start else "they overlap"))
            raise _bad(name, "offsets", detail)
        start = end
        numel = 1
        for dim in shape:
            numel *= dim
            if numel > _USIZE_MAX:
                raise _bad(name, "overflow", f"tensor {key!r} has the shape {shape}: too many elements for 64 bits")
        bits = numel * DTYPE_BITS[dtype]
        if bits > _USIZE_MAX:
            raise _bad(name, "overflow", f"tensor {key!r} ({dtype} {shape}) is too big for 64 bits")
        if bits % 8:
            raise _bad(name, "misaligned", f"tensor {key!r} ({dtype} {shape}) does not end on a byte")
        if end - begin != bits // 8:
            raise _bad(name, "size", f"tensor {key!r} is {dtype} {shape}, {bits // 8} bytes, but its data_offsets "
                                     f"[{begin}, {end}] span {end - begin}")
    return start


def _what(value: Any) -> str:
    if isinstance(value, _Obj):
        return "an object"
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
