"""torchao's Python call syntax for configs, read with an AST walk (never eval) and written back.

Allowed, and nothing else:

- calls of torchao config classes (``Int8WeightOnlyConfig(...)``), granularities (``PerGroup(128)``) and the small
  helper records configs take (``Float8MMConfig(...)``), with positional and keyword arguments;
- enum members of torchao's enums (``MappingType.ASYMMETRIC``) and torch dtypes (``torch.int4``): the only
  attribute accesses;
- literals: numbers (a leading minus included), strings, True / False / None, lists, tuples, dicts with string keys.

The names come from the modules torchao's own ``config_from_dict`` may instantiate (``ALLOWED_AO_MODULES``), so the
call syntax reaches exactly the classes a ``config_to_dict`` JSON file can. No other name, no import, no subscript, no
operator, no ``**kwargs`` and no keyword starting with ``_``: each is refused with a line naming it.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from publisher.errors import UsageError

MAX_TEXT = 4000  # characters of one config: a config is a line, not a program
MAX_DEPTH = 12  # nested calls and literals
# where the card's imports come from: the first module that exports a name (the public path users write)
MODULE_ORDER = ("torchao.quantization", "torchao.quantization.quantize_.workflows", "torchao.quantization.quantize_.common",
                "torchao.prototype.mx_formats", "torchao.prototype.quantization", "torchao.prototype.awq",
                "torchao.prototype.smoothquant", "torchao.prototype.parq", "torchao.sparsity.sparse_api")


@dataclass(frozen=True)
class Allowed:
    """The torchao names the call syntax may use, each with the module it is imported from."""

    configs: dict[str, tuple[str, Any]]  # AOBaseConfig subclasses
    callables: dict[str, tuple[str, Any]]  # granularities and helper records (dataclasses, named tuples)
    enums: dict[str, tuple[str, Any]]
    dtypes: frozenset[str]  # torch.<name> that are dtypes


CORE = MODULE_ORDER[:3]  # torchao's stable API; the prototype modules (they import transformers) only on a miss


@functools.lru_cache(maxsize=2)
def allowed(full: bool = True) -> Allowed:
    """The allowlist: every name ``config_from_dict`` could instantiate (``full``), or those of torchao's stable
    modules only (cheaper to import; ``names`` falls back to the full table for a name it lacks)."""
    import torch
    from torchao.core.config import ALLOWED_AO_MODULES, AOBaseConfig
    from torchao.quantization.granularity import Granularity

    order = [m for m in MODULE_ORDER if m in ALLOWED_AO_MODULES] + sorted(set(ALLOWED_AO_MODULES) - set(MODULE_ORDER))
    if not full:
        order = [m for m in order if m in CORE]
    configs: dict[str, tuple[str, Any]] = {}
    callables: dict[str, tuple[str, Any]] = {}
    enums: dict[str, tuple[str, Any]] = {}
    for module_path in order:
        try:
            module = importlib.import_module(module_path)
        except ImportError:  # an optional prototype module: its names are simply not allowed
            continue
        for name in dir(module):
            obj = getattr(module, name)
            if name.startswith("_") or not inspect.isclass(obj) or obj.__name__ != name:
                continue  # aliases (lower-case function-style names) are not classes of that name
            if issubclass(obj, AOBaseConfig) and obj is not AOBaseConfig:
                configs.setdefault(name, (module_path, obj))
            elif issubclass(obj, Granularity) and obj is not Granularity:
                callables.setdefault(name, (module_path, obj))
            elif issubclass(obj, enum.Enum):
                enums.setdefault(name, (module_path, obj))
            elif dataclasses.is_dataclass(obj) or (issubclass(obj, tuple) and hasattr(obj, "_fields")):
                callables.setdefault(name, (module_path, obj))
    dtypes = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))
    return Allowed(configs, callables, enums, dtypes)


def names_for(name: str) -> Allowed:
    """The allowlist table that knows ``name`` if any does (the stable modules first)."""
    core = allowed(False)
    if name in core.configs or name in core.callables or name in core.enums:
        return core
    return allowed(True)


@dataclass(frozen=True)
class Parsed:
    config: Any  # the torchao AOBaseConfig
    names: tuple[str, ...]  # the torchao names the text uses (for its imports)
    uses_torch: bool

    def imports(self) -> str:
        return imports_for(self.names, self.uses_torch)


def imports_for(names: tuple[str, ...] | list[str], uses_torch: bool) -> str:
    """``import torch`` and ``from torchao... import A, B`` lines for these names, as a user writes them."""
    by_module: dict[str, list[str]] = {}
    for name in sorted(set(names)):
        table = names_for(name)
        module = (table.configs.get(name) or table.callables.get(name) or table.enums.get(name) or ("torchao.quantization",))[0]
        by_module.setdefault(module, []).append(name)
    lines = ["import torch"] if uses_torch else []
    if lines and by_module:
        lines.append("")
    lines += [f"from {m} import {', '.join(ns)}" for m, ns in sorted(by_module.items(), key=lambda kv: MODULE_ORDER.index(kv[0])
                                                                        if kv[0] in MODULE_ORDER else len(MODULE_ORDER))]
    return "\n".join(lines)


class Rejected(UsageError):
    """torchao refused the config (its own message, and the working form where it gave one)."""


def parse(text: str, what: str = "--quant") -> Parsed:
    """The config ``text`` builds. UsageError (exit 2) for anything outside the allowlist and for a config torchao
    rejects (``Rejected``); ``what`` names the argument in the message."""
    return _read(text, what, dry=False)


def check_shape(text: str, what: str = "--quant") -> tuple[str, dict[str, Any]]:
    """The checks of ``parse`` that need no torchao (run before anything heavy is imported): the text is one call,
    and every node is a call of a name, ``torch.<name>``, ``<Name>.<MEMBER>`` or a literal. Which names are torchao's
    is checked by ``parse``. Returns the class called and its keyword arguments as text (a call as the name it calls,
    ``<Name>.<MEMBER>`` as that string): enough for the device rules (configs/facts.py ``rule_for_call``)."""
    shape = _read(text, what, dry=True)
    return shape.names[0] if shape.names else "", shape.config or {}


def _read(text: str, what: str, dry: bool) -> Parsed:
    source = text.strip()
    if not source:
        raise UsageError(f"{what}: the config is empty; give a recipe name or a call such as Int8WeightOnlyConfig()")
    if len(source) > MAX_TEXT:
        raise UsageError(f"{what}: the config is {len(source)} characters long (at most {MAX_TEXT}); put it in a JSON file")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        raise UsageError(f"{what} {source!r} is not a config call ({exc.msg} at column {exc.offset}); write it as "
                         "torchao's Python call, e.g. Int8WeightOnlyConfig(granularity=PerGroup(128))") from None
    reader = _Reader(what, source, dry)
    body = tree.body
    if not (isinstance(body, ast.Call) and isinstance(body.func, ast.Name)
            and (body.func.id.endswith("Config") if dry else body.func.id in names_for(body.func.id).configs)):
        func = body.func if isinstance(body, ast.Call) else body
        found = func.id if isinstance(func, ast.Name) else ast.get_source_segment(source, func) or _kind(func)
        raise UsageError(f"{what} {source!r}: a config is a call of a torchao config class such as "
                         f"Int8WeightOnlyConfig(...), not of {found}{reader.close_config(found)}")
    config = reader.value(body, 0)
    if dry:  # the top-level call's name first, and its keyword arguments in place of a config
        return Parsed(reader.top_kwargs, (body.func.id,), reader.uses_torch)
    return Parsed(config, tuple(sorted(reader.names)), reader.uses_torch)


class _Reader:
    """Walks the AST, building each allowed node; refuses the rest with the node's own text."""

    def __init__(self, what: str, source: str, dry: bool = False) -> None:
        self.what, self.source, self.dry = what, source, dry  # dry: the shape only (no torchao, nothing built)
        self.names: set[str] = set()
        self.uses_torch = False
        self.top_kwargs: dict[str, Any] = {}  # dry: the outermost call's keywords, as text

    def refuse(self, node: ast.AST, why: str) -> UsageError:
        snippet = ast.get_source_segment(self.source, node) or _kind(node)
        return UsageError(f"{self.what} {self.source!r}: {snippet!r} is not allowed in a config ({why})")

    def close_config(self, name: str) -> str:
        import difflib

        if self.dry:
            return ""
        close = difflib.get_close_matches(name, list(allowed().configs), n=1)
        return f" (did you mean {close[0]}?)" if close else ""

    def value(self, node: ast.AST, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise self.refuse(node, f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, ast.Constant):
            if isinstance(node.value, (bool, int, float, str)) or node.value is None:
                return node.value
            raise self.refuse(node, "only numbers, strings, True, False and None are literals here")
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and isinstance(node.operand, ast.Constant) \
                and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
            return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.value(e, depth + 1) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.Dict):
            out = {}
            for k, v in zip(node.keys, node.values):
                if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
                    raise self.refuse(k or node, "dict keys must be strings")
                out[k.value] = self.value(v, depth + 1)
            return out
        if isinstance(node, ast.Attribute):
            return self.attribute(node)
        if isinstance(node, ast.Name):
            if self.dry:
                raise self.refuse(node, "a bare name: call a class (Name(...)), or write torch.<dtype> or <Enum>.<MEMBER>")
            table = names_for(node.id)
            if node.id in table.configs or node.id in table.callables:
                raise self.refuse(node, f"a class must be called: {node.id}(...)")
            if node.id in table.enums:
                raise self.refuse(node, f"name one of its members: {node.id}.<MEMBER>")
            raise self.refuse(node, "not a torchao config, granularity or enum name; variables are not allowed")
        if isinstance(node, ast.Call):
            return self.call(node, depth)
        raise self.refuse(node, f"{_kind(node)} is outside the config syntax: calls of torchao classes, torch.<dtype>, "
                                "<Enum>.<MEMBER> and literals only")

    def attribute(self, node: ast.Attribute) -> Any:
        if not isinstance(node.value, ast.Name):
            raise self.refuse(node, "attribute access is limited to torch.<dtype> and <Enum>.<MEMBER>")
        owner, attr = node.value.id, node.attr
        if self.dry:  # torch.<name> or an enum-like (capitalised) name; which ones exist is for the full read
            if attr.startswith("_") or not (owner == "torch" or owner[:1].isupper()):
                raise self.refuse(node, "attribute access is limited to torch.<dtype> and <Enum>.<MEMBER>")
            return f"{owner}.{attr}"
        table = names_for(owner)
        if owner == "torch":
            if attr not in table.dtypes:
                raise self.refuse(node, f"torch.{attr} is not a torch dtype; only torch.<dtype> is allowed")
            import torch

            self.uses_torch = True
            return getattr(torch, attr)
        if owner in table.enums:
            cls = table.enums[owner][1]
            if attr.startswith("_") or attr not in cls.__members__:
                raise self.refuse(node, f"{owner} has no member {attr}; its members: {', '.join(cls.__members__)}")
            self.names.add(owner)
            return cls[attr]
        raise self.refuse(node, "attribute access is limited to torch.<dtype> and <Enum>.<MEMBER>")

    def call(self, node: ast.Call, depth: int) -> Any:
        if not isinstance(node.func, ast.Name):
            raise self.refuse(node.func, "only torchao config, granularity and helper classes can be called, by name")
        name = node.func.id
        if name.startswith("_"):
            raise self.refuse(node.func, "not a torchao config, granularity or helper class; only those can be called")
        if self.dry:
            if not name[:1].isupper():  # torchao's classes are capitalised; print, eval, open are not
                raise self.refuse(node.func, "not a torchao config, granularity or helper class; only those can be called")
            entry: tuple[str, Any] | None = ("", None)
        else:
            table = names_for(name)
            entry = table.configs.get(name) or table.callables.get(name)
        if entry is None:
            raise self.refuse(node.func, "not a torchao config, granularity or helper class; only those can be called"
                                         + self.close_config(name))
        args = []
        for a in node.args:
            if isinstance(a, ast.Starred):
                raise self.refuse(a, "*args unpacking is not allowed")
            args.append(self.value(a, depth + 1))
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise self.refuse(kw.value, "**kwargs unpacking is not allowed")
            if kw.arg.startswith("_"):
                raise self.refuse(kw, f"keyword {kw.arg} starts with an underscore")
            kwargs[kw.arg] = self.value(kw.value, depth + 1)
        self.names.add(name)
        cls = entry[1]
        if self.dry:
            if depth == 0:
                self.top_kwargs = kwargs
            return name
        try:
            return cls(*args, **kwargs)
        except (TypeError, ValueError, AssertionError, NotImplementedError, AttributeError, KeyError) as exc:
            segment = ast.get_source_segment(self.source, node) or name
            raise Rejected(rejection(self.what, self.source, segment, cls, exc, kwargs)) from None


def _kind(node: ast.AST) -> str:
    return {"BinOp": "an operator", "Subscript": "a subscript", "Lambda": "a lambda", "JoinedStr": "an f-string",
            "ListComp": "a comprehension", "GeneratorExp": "a comprehension", "NamedExpr": "an assignment",
            "Compare": "a comparison", "BoolOp": "a boolean operator", "IfExp": "a conditional",
            "Await": "await", "Starred": "unpacking"}.get(type(node).__name__, f"a {type(node).__name__} expression")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for prefix in ("Failed to create instance of ",):  # config_from_dict's wrapper adds nothing the user needs
        if text.startswith(prefix) and ": " in text:
            text = text.split(": ", 1)[1]
    return (text.splitlines() or [type(exc).__name__])[0][:300] or type(exc).__name__


def rejection(what: str, source: str, segment: str, cls: Any, exc: BaseException, kwargs: dict[str, Any]) -> str:
    """One line: the argument, torchao's words, and (where torchao names the fix) the working form, checked."""
    import difflib
    import re

    said = first_line(exc)
    line = f"{what} {source!r}: torchao rejects {segment} ({type(exc).__name__}: {said})"
    unknown = re.search(r"unexpected keyword argument '(\w+)'", said)
    if unknown and dataclasses.is_dataclass(cls):
        close = difflib.get_close_matches(unknown.group(1), [f.name for f in dataclasses.fields(cls)], n=1)
        return line + (f"; did you mean {close[0]}=?" if close else
                       f"; {getattr(cls, '__name__', 'it')} takes: {', '.join(f.name for f in dataclasses.fields(cls))}")
    working = working_form(source, said)
    return line + (f"; the working form: {working}" if working else "")


def working_form(source: str, said: str) -> str | None:
    """torchao's "Use X=Y instead" applied to ``source``: the arguments its message names are dropped, as are those
    equal to their defaults, and X=Y is added; returned only if it parses and builds."""
    import re

    hint = re.search(r"[Uu]se (\w+)=(.+?) instead", said)
    if not hint:
        return None
    keyword, value = hint.group(1), hint.group(2).strip()
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        return None
    cls = names_for(call.func.id).configs.get(call.func.id, (None, None))[1]
    defaults = {f.name: f.default for f in dataclasses.fields(cls)} if cls is not None and dataclasses.is_dataclass(cls) else {}
    kept = []
    for kw in call.keywords:
        if kw.arg is None or kw.arg == keyword or re.search(rf"\b{re.escape(kw.arg)}\b", said.split("Use ")[0]):
            continue
        if isinstance(kw.value, ast.Constant) and kw.arg in defaults and defaults[kw.arg] == kw.value.value:
            continue  # e.g. version=2, the default: the working form need not repeat it
        kept.append(ast.get_source_segment(source.strip(), kw) or "")
    args = [ast.get_source_segment(source.strip(), a) or "" for a in call.args]
    candidate = f"{call.func.id}({', '.join([*args, *kept, f'{keyword}={value}'])})"
    try:
        parse(candidate)
    except UsageError:
        return None
    return candidate
