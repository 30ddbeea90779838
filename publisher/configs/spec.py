"""What ``--quant`` takes: a recipe name, a config call, a ``config_to_dict`` JSON file (or inline JSON object), or a
per-component mapping of those; each becomes a ``ConfigSpec`` that remembers the text exactly as given.

One ``--quant`` value is split on its top-level commas only (commas inside a call's parentheses, brackets or quotes
belong to the call), so ``--quant int8wo,float8wo`` still names two recipes while
``--quant "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))"`` is one config. Items written
``COMPONENT=VALUE`` make one per-component mapping, published as one repo: ``--quant transformer=float8wo,
text_encoder_2=int8wo``. Repeating ``--quant`` always means another repo.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publisher.configs import render, syntax
from publisher.errors import UsageError

MAX_JSON_BYTES = 1 << 20
_COMPONENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)\s*(.*)$", re.S)


@dataclass(frozen=True)
class ConfigSpec:
    """One torchao config and how it was given."""

    given: str  # exactly as given: the recipe name, the call text, the JSON text
    source: str  # "recipe" | "call" | "json"
    call: str  # call syntax that builds it ("" when the config has none: the Python then reads its JSON)
    canonical: str  # config_to_dict as sorted JSON: its identity
    names: tuple[str, ...] = ()  # torchao names the call uses
    uses_torch: bool = False
    recipe: str | None = None  # registry name, when given by name
    origin: str = ""  # the file a JSON config was read from
    obj: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def config(self) -> Any:
        """The torchao config (one shared object per spec: quantize never mutates it)."""
        return self.obj

    @property
    def python(self) -> str:
        """The expression that builds it, for the card (the call, or config_from_dict of its JSON)."""
        return self.call or f"config_from_dict(json.loads({self.canonical!r}))"

    def imports(self) -> str:
        if self.call:
            return syntax.imports_for(self.names, self.uses_torch)
        return "import json\n\nfrom torchao.core.config import config_from_dict"

    @property
    def label(self) -> str:
        """Short text for logs and tables: the recipe name, else the config's class."""
        return self.recipe or type(self.obj).__name__

    def to_json(self) -> dict[str, Any]:
        return {"given": self.given, "source": self.source, "recipe": self.recipe, "call": self.call or None,
                "config": json.loads(self.canonical)}


def from_call(text: str, what: str, recipe: str | None = None) -> ConfigSpec:
    parsed = syntax.parse(text, what)
    return ConfigSpec(recipe or text.strip(), "recipe" if recipe else "call", text.strip(), render.canonical(parsed.config),
                      parsed.names, parsed.uses_torch, recipe, obj=parsed.config)


def from_config(config: Any, given: str, source: str = "json", origin: str = "") -> ConfigSpec:
    """A spec for a config object (read from JSON): its call text when one reads back as the same config."""
    try:
        call, names, uses_torch = render.write(config)
    except render.NotWritable:
        call, names, uses_torch = "", (), False
    return ConfigSpec(given, source, call, render.canonical(config), names, uses_torch, origin=origin, obj=config)


def from_json_text(text: str, what: str, origin: str = "") -> ConfigSpec:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} {origin or text[:80]!r} is not JSON ({exc.msg} at line {exc.lineno}); give a "
                         "config_to_dict object such as {\"_type\": \"Int8WeightOnlyConfig\", \"_data\": {}}") from None
    return from_dict(data, what, json.dumps(data, indent=2) if origin else text.strip(), origin)


def from_dict(data: Any, what: str, given: str, origin: str = "") -> ConfigSpec:
    """A ``config_to_dict`` object, rebuilt by torchao's own ``config_from_dict`` (which instantiates torchao classes
    only)."""
    from torchao.core.config import config_from_dict

    where = f"{what} {origin}" if origin else what
    if not isinstance(data, dict) or "_type" not in data or "_data" not in data:
        raise UsageError(f"{where}: a JSON config is torchao's config_to_dict form, an object with \"_type\" and "
                         "\"_data\" (e.g. {\"_type\": \"Int8WeightOnlyConfig\", \"_version\": 2, \"_data\": {}})")
    try:
        config = config_from_dict(data)
    except (ValueError, TypeError, AssertionError, AttributeError, KeyError, NotImplementedError) as exc:
        said = syntax.first_line(exc)
        working = syntax.working_form(f"{data['_type']}()", said) if "instead" in said else None
        raise syntax.Rejected(f"{where}: torchao rejects {data.get('_type')} ({type(exc).__name__}: {said})"
                              + (f"; the working form: {working}" if working else "")) from None
    if type(config).__name__ not in syntax.allowed().configs:
        raise UsageError(f"{where}: {data['_type']} is not a torchao config class")
    return from_config(config, given, "json", origin)


QUANT_TAKES = "--quant takes a recipe name, a config call or a config_to_dict JSON file"


def read_json_file(value: str, what: str, takes: str = QUANT_TAKES) -> tuple[str, str]:
    """(text, path) of a JSON file argument, through the project's JSON reader rules (size, plain file); ``takes``:
    what the option takes, said when the file is missing."""
    path = Path(value).expanduser()
    if not path.is_file():
        said = "is a folder, not a file" if path.is_dir() else "no such file"
        raise UsageError(f"{what} {value!r}: {said}: {path.resolve(strict=False)}; {takes}")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise UsageError(f"{what} {value!r} is over {MAX_JSON_BYTES // 1024} KB; a config file is small")
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{what} {value!r} cannot be read ({exc}); give a readable UTF-8 JSON file") from None


def kind_of(value: str, recipes: Mapping[str, str]) -> str:
    """"recipe", "json" (inline), "call", "file" or "unknown"."""
    if value in recipes:
        return "recipe"
    if value.startswith("{"):
        return "json"
    if "(" in value:
        return "call"
    if value.endswith(".json") or "/" in value or Path(value).expanduser().is_file():
        return "file"
    return "unknown"


def parse_value(text: str, what: str, recipes: Mapping[str, str]) -> ConfigSpec:
    """One config: a registry name (``recipes``: name -> its call text), a call, inline JSON or a JSON file."""
    value = text.strip()
    kind = kind_of(value, recipes)
    if kind == "recipe":
        return from_call(recipes[value], what, recipe=value)
    if kind == "json":
        return from_json_text(value, what)
    if kind == "call":
        return from_call(value, what)
    if kind == "file":
        body, path = read_json_file(value, what)
        return from_json_text(body, what, origin=path)
    raise unknown(value, what, recipes)


def precheck_value(text: str, what: str, recipes: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    """The checks of ``parse_value`` that need no torchao (before anything heavy is imported); returns the config's
    class and keyword arguments as text (configs/facts.py ``rule_for_call``)."""
    value = text.strip()
    kind = kind_of(value, recipes)
    if kind in ("call", "recipe"):
        return syntax.check_shape(recipes.get(value, value), what)
    if kind in ("json", "file"):
        body, origin = (value, "") if kind == "json" else read_json_file(value, what)
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{what} {origin or value[:80]!r} is not JSON ({exc.msg} at line {exc.lineno}); give a "
                             "config_to_dict object such as {\"_type\": \"Int8WeightOnlyConfig\", \"_data\": {}}") from None
        if not isinstance(data, dict) or "_type" not in data or not isinstance(data.get("_data"), dict):
            raise UsageError(f"{what} {origin or 'JSON'}: a JSON config is torchao's config_to_dict form, an object with "
                             "\"_type\" and \"_data\"")
        return str(data["_type"]), data["_data"]
    raise unknown(value, what, recipes)


def unknown(value: str, what: str, recipes: Mapping[str, str]) -> UsageError:
    """The error for a word that is no recipe; the closest name first (INT8WO, int8w0, in8wo: int8wo)."""
    close = _closest_recipe(value, recipes)
    hint = f" (did you mean {close}?)" if close else ""
    return UsageError(f"{what}: unknown recipe {value!r}{hint}; choose one of: {', '.join(recipes)} (see `hf-ao-publish "
                      "recipes`), or give a torchao config such as 'Int8WeightOnlyConfig(granularity=PerGroup(128))' or a "
                      "config_to_dict JSON file")


def _closest_recipe(value: str, recipes: Mapping[str, str]) -> str | None:
    """The recipe name ``value`` is most likely a typo of: the same name in another case, else the closest by
    difflib (names compared in lower case)."""
    import difflib

    lower = {name.lower(): name for name in recipes}
    close = difflib.get_close_matches(value.lower(), list(lower), n=1)
    return lower[close[0]] if close else None


def split_top(text: str) -> list[str]:
    """``text`` split on commas outside parentheses, brackets, braces and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote and text[i - 1] != "\\":
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


@dataclass(frozen=True)
class Quant:
    """One ``--quant`` unit, published as one repo: one config for every quantized component, or one per component."""

    given: str  # the unit as given on the command line
    default: ConfigSpec | None = None
    mapping: tuple[tuple[str, ConfigSpec], ...] = ()

    def for_component(self, name: str) -> ConfigSpec:
        found = dict(self.mapping).get(name, self.default)
        if found is None:
            raise UsageError(f"--quant {self.given!r} names no config for component {name or 'model'}")
        return found

    def specs(self) -> list[ConfigSpec]:
        return [self.default] if self.default is not None else [s for _, s in self.mapping]


def _units(value: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """One --quant value as its units: (item, []) for each plain item, or (value, [(component, config text)...])
    for one per-component mapping."""
    items = split_top(value)
    pairs = [_COMPONENT.match(item) for item in items]
    named = [p is not None for p in pairs]
    if any(named) and not all(named):
        raise UsageError(f"--quant {value!r} mixes COMPONENT=CONFIG pairs with plain recipes; give the per-component "
                         "mapping in a --quant of its own (repeat --quant for another repo)")
    if items and all(named):
        mapping: list[tuple[str, str]] = []
        for p in pairs:
            assert p is not None
            if p.group(1) in dict(mapping):
                raise UsageError(f"--quant {value!r} names component {p.group(1)} twice; give it one config")
            mapping.append((p.group(1), p.group(2).strip()))
        return [(value.strip(), mapping)]
    return [(item, []) for item in items]


def precheck_quant(values: list[str] | tuple[str, ...], recipes: Mapping[str, str]
                   ) -> list[tuple[str, tuple[str, ...], list[tuple[str, dict[str, Any]]]]]:
    """The checks of ``parse_quant`` that need no torchao; each unit as (its text, its mapped components (empty: one
    config for every quantized component), the class and keywords of each of its configs)."""
    import logging

    out: list[tuple[str, tuple[str, ...], list[tuple[str, dict[str, Any]]]]] = []
    for value in values:
        for item, mapping in _units(value):
            shapes = [precheck_value(text, f"--quant {comp}=" if comp else "--quant", recipes)
                      for comp, text in mapping or [("", item)]]
            if any(u[0] == item for u in out):
                logging.getLogger(__name__).warning("--quant names %s more than once; it is published once", item)
            out.append((item, tuple(c for c, _ in mapping), shapes))
    return out


def parse_quant(values: list[str] | tuple[str, ...], recipes: Mapping[str, str]) -> list[Quant]:
    """Every ``--quant`` value, in order: each top-level item is a recipe of its own, unless the items are
    ``COMPONENT=VALUE`` pairs, which together make one per-component mapping."""
    out: list[Quant] = []
    for value in values:
        for item, mapping in _units(value):
            if mapping:
                specs = tuple((c, parse_value(t, f"--quant {c}=", recipes)) for c, t in mapping)
                out.append(Quant(item, mapping=specs))
            else:
                out.append(Quant(item, default=parse_value(item, "--quant", recipes)))
    return out
