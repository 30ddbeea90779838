"""A torchao config object written back as the call syntax that builds it (configs/syntax.py reads it).

Used where the user gave no call text (a ``config_to_dict`` JSON file, a config declared by a checkpoint): only the
arguments that differ from their defaults are written, and the text is kept only when reading it back gives the same
``config_to_dict``; otherwise the Python falls back to ``config_from_dict`` of the JSON itself.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

from publisher.configs import syntax


class NotWritable(ValueError):
    """A value the call syntax has no form for."""


def canonical(config: Any) -> str:
    """``config_to_dict`` as sorted JSON: the identity of a config (equal configs, equal text)."""
    from torchao.core.config import config_to_dict

    return json.dumps(config_to_dict(config), sort_keys=True)


def write(config: Any) -> tuple[str, tuple[str, ...], bool]:
    """(call text, torchao names used, uses torch). NotWritable when no call text reads back as ``config``."""
    names: set[str] = set()
    flags = {"torch": False}
    text = _value(config, names, flags)
    try:
        back = syntax.parse(text, "render")
    except syntax.UsageError as exc:
        raise NotWritable(str(exc)) from None
    if canonical(back.config) != canonical(config):
        raise NotWritable(f"{text} does not read back as the same config")
    return text, tuple(sorted(names)), flags["torch"]


def _value(v: Any, names: set[str], flags: dict[str, bool]) -> str:
    import torch

    if v is None or isinstance(v, (bool, int, float, str)):
        return repr(v)
    if isinstance(v, torch.dtype):
        flags["torch"] = True
        return str(v)  # "torch.int4"
    if isinstance(v, enum.Enum):
        names.add(type(v).__name__)
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x, names, flags) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k!r}: {_value(x, names, flags)}" for k, x in v.items()) + "}"
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a named tuple (Float8MMConfig)
        return _call(type(v).__name__, [(f, getattr(v, f), getattr(type(v), "_field_defaults", {}).get(f, dataclasses.MISSING))
                                        for f in v._fields], names, flags)
    if isinstance(v, tuple):
        return "(" + ", ".join(_value(x, names, flags) for x in v) + ("," if len(v) == 1 else "") + ")"
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        fields = []
        for f in dataclasses.fields(v):
            if not f.init:
                continue
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            fields.append((f.name, getattr(v, f.name), default))
        return _call(type(v).__name__, fields, names, flags)
    raise NotWritable(f"{type(v).__name__} values have no call syntax")


def _call(name: str, fields: list[tuple[str, Any, Any]], names: set[str], flags: dict[str, bool]) -> str:
    if name not in syntax.allowed().configs and name not in syntax.allowed().callables:
        raise NotWritable(f"{name} is not a torchao class the call syntax allows")
    names.add(name)
    parts = []
    for key, value, default in fields:
        if default is not dataclasses.MISSING and _same(value, default):
            continue
        parts.append(f"{key}={_value(value, names, flags)}")
    return f"{name}({', '.join(parts)})"


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False
