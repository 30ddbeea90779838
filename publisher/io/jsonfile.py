"""The one reader for the JSON files this tool parses: ``model_index.json``, every ``*config.json``, the
``*.safetensors.index.json`` of a sharded checkpoint (and a verify target's copies of them).

Each must be UTF-8, valid JSON, a JSON object, and no larger than its limit; anything else is one
``InputError`` naming the file. The limit is checked before a byte is parsed (for a Hub base, from the file
listing, before it is downloaded): real configs are a few KB and real indexes a few MB, while parsing a
200 MB JSON file costs over a gigabyte of memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from publisher.errors import InputError
from publisher.io.localfiles import open_regular

MiB = 1024 * 1024
CONFIG_LIMIT = 16 * MiB  # model_index.json and every *config.json
INDEX_LIMIT = 64 * MiB  # *.index.json (about 100 bytes per tensor: a 600k-tensor index)


def limit_for(name: str) -> int:
    return INDEX_LIMIT if name.endswith(".index.json") else CONFIG_LIMIT


def parsed_here(name: str) -> bool:
    """Whether a base file is read through this module (and so size-limited before it is fetched)."""
    base = name.rsplit("/", 1)[-1]
    return base == "model_index.json" or base.endswith("config.json") or base.endswith(".safetensors.index.json")


def too_big(what: str, size: int, limit: int) -> InputError:
    return InputError(f"{what} is {size / 1e6:.1f} MB, over the {limit // MiB} MiB limit for the JSON files this tool "
                      "parses; it is not read (a real one is a few KB to a few MB): fix the file", kind="json-size")


def parse_object(data: bytes, what: str, limit: int | None = None) -> dict[str, Any]:
    """``data`` as a JSON object; ``what`` names the file in the error."""
    limit = limit_for(what) if limit is None else limit
    if len(data) > limit:
        raise too_big(what, len(data), limit)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 text (byte {exc.start}); fix the file", kind="json-utf8") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); fix the file",
                         kind="json-syntax") from None
    except (ValueError, RecursionError) as exc:  # integers over 4300 digits, nesting deeper than Python's stack
        raise InputError(f"{what} is not valid JSON ({type(exc).__name__}); fix the file", kind="json-syntax") from None
    if not isinstance(doc, dict):
        raise InputError(f"{what} is not a JSON object (it is {_type_name(doc)}); fix the file", kind="json-type")
    return doc


def read_object(path: Path, what: str | None = None, limit: int | None = None,
                roots: tuple[Path, ...] | None = None) -> dict[str, Any]:
    """A local JSON file as an object: its size is checked before it is read, and it is opened with
    ``localfiles.open_regular`` (no FIFO, no device; ``roots``: where its resolved path must lie)."""

    what = what or str(path)
    limit = limit_for(Path(path).name) if limit is None else limit
    with open_regular(path, roots) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise too_big(what, size, limit)
        data = f.read(limit + 1)
    return parse_object(data, what, limit)


def weight_map(index: dict[str, Any], what: str) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index: tensor name -> shard file name."""
    if "weight_map" not in index:
        raise InputError(f"{what} has no weight_map (the table of tensor name -> shard file); fix the index",
                         kind="index")
    mapping = index["weight_map"]
    if not isinstance(mapping, dict):
        raise InputError(f"{what}: weight_map is {_type_name(mapping)}, not an object mapping tensor names to shard "
                         "files; fix the index", kind="index")
    bad = next((k for k, v in mapping.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise InputError(f"{what}: weight_map gives tensor {bad!r} the shard {mapping[bad]!r}, not a file name; "
                         "fix the index", kind="index")
    return dict(mapping)


def _type_name(value: Any) -> str:
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)
