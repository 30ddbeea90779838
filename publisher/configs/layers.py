"""Per-layer configs: ``--layer-config [COMPONENT=]FILE`` (or an inline JSON object), written into the component's
``quantization_config`` as torchao's ``FqnToConfig`` (which entry each library applies to a layer is its adapter's
rule: publisher/adapters).

The file maps a layer to a config: the key is a module (or parameter) fqn, or ``re:`` and a pattern that must match the
whole fqn; the value is a recipe name, a config call, a ``config_to_dict`` object, or ``null`` to leave the layer
unquantized. ``--quant`` gives the config of every other layer (the ``_default`` entry), so the file has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from publisher.configs import spec as specs
from publisher.errors import UsageError

_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(?!=)(.+)$", re.S)


@dataclass(frozen=True)
class LayerTable:
    """One component's per-layer entries, in the order given (the first matching pattern wins)."""

    component: str | None  # None: the only quantized component
    entries: tuple[tuple[str, specs.ConfigSpec | None], ...]
    given: str  # the JSON as given
    origin: str = ""  # the file it was read from ("" for inline JSON)
    guards: tuple[str, ...] = ()  # keys set to None ahead of the entries (stages/layercheck.py: transformers' biases)

    def patterns(self) -> list[str]:
        return [k for k, _ in self.entries if k.startswith("re:")]

    def canonical(self) -> str:
        return json.dumps([[k, json.loads(s.canonical) if s else None] for k, s in self.entries])

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "file": self.origin or None, "given": self.given, "guards": list(self.guards),
                "entries": {k: (s.to_json() if s else None) for k, s in self.entries}}

    def inline(self) -> str:
        """``COMPONENT={...}``: the table as one --layer-config value that needs no file (an HF Jobs command line)."""
        # a recipe stays its name (as in job_args: the job's state and card say it as given here)
        body = json.dumps({k: (s.recipe or s.call or json.loads(s.canonical)) if s else None for k, s in self.entries})
        return f"{self.component}={body}" if self.component is not None else body


LAYER_CONFIG_TAKES = ('--layer-config takes a JSON file, or a JSON object inline (\'{"re:.*proj_out": null}\'), '
                      "each mapping a layer to a config")


def _load(value: str) -> tuple[str | None, dict[str, Any], str, str, str]:
    """(component, the JSON object, its text, the file, how to name it) of one --layer-config value; keys checked."""
    what = "--layer-config"
    text = value.strip()
    component = None
    prefix = _PREFIX.match(text)
    if prefix and not text.startswith("{"):
        component, text = prefix.group(1), prefix.group(2).strip()
        what = f"--layer-config {component}="
    if text.startswith(("{", "[")):  # inline JSON (a list is refused below, with the form it must have)
        body, origin = text, ""
    else:
        body, origin = specs.read_json_file(text, what, LAYER_CONFIG_TAKES)
    try:
        data = json.loads(body, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} {origin or text[:60]!r} is not JSON ({exc.msg} at line {exc.lineno}); give an object "
                         'mapping layers to configs, e.g. {"re:.*\\\\.proj_out": null}') from None
    if not isinstance(data, dict) or not data:
        raise UsageError(f"{what} {origin or text[:60]!r}: give a JSON object mapping a layer (fqn or re:pattern) to a "
                         "config or null, with at least one entry")
    for key in data:
        where = f"{what} {origin or 'JSON'}: entry {key!r}"
        if key == "_default":
            raise UsageError(f"{where}: --quant gives the config of every layer the file does not name; drop _default")
        if not key or key != key.strip():
            raise UsageError(f"{where}: a key is a module fqn or re:PATTERN, without surrounding spaces")
        if key.startswith("re:"):
            try:
                re.compile(key[3:])
            except re.error as exc:
                raise UsageError(f"{where} is not a valid regular expression ({exc})") from None
    return component, data, body, origin, what


def precheck_layer_arg(value: str, recipes: Mapping[str, str]) -> tuple[str | None, list[tuple[str, dict[str, Any]]]]:
    """The checks of ``parse_layer_arg`` that need no torchao; returns the component it names (None: not named) and
    the class and keywords of each config it holds."""
    component, data, _, origin, what = _load(value)
    shapes = []
    for key, raw in data.items():
        where = f"{what} {origin or 'JSON'}: entry {key!r}"
        if isinstance(raw, str):
            shapes.append(specs.precheck_value(raw, where, recipes))
        elif isinstance(raw, dict) and "_type" in raw and isinstance(raw.get("_data"), dict):
            shapes.append((str(raw["_type"]), raw["_data"]))
        elif raw is not None:
            raise UsageError(f"{where}: {json.dumps(raw)[:60]} is not a config; give a recipe name, a config call, a "
                             "config_to_dict object or null")
    return component, shapes


def parse_layer_arg(value: str, recipes: Mapping[str, str]) -> LayerTable:
    component, data, body, origin, what = _load(value)
    entries = [(key, _value(raw, f"{what} {origin or 'JSON'}: entry {key!r}", recipes)) for key, raw in data.items()]
    return LayerTable(component, tuple(entries), body.strip(), origin)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise UsageError(f"--layer-config: layer {k!r} appears twice; give each layer once")
        seen[k] = v
    return seen


def _value(raw: Any, where: str, recipes: Mapping[str, str]) -> specs.ConfigSpec | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        spec = specs.parse_value(raw, where, recipes)
    elif isinstance(raw, dict):
        spec = specs.from_dict(raw, where, json.dumps(raw))
    else:
        raise UsageError(f"{where}: {json.dumps(raw)[:60]} is not a config; give a recipe name, a config call, a "
                         "config_to_dict object or null")
    if type(spec.config).__name__ in ("FqnToConfig", "ModuleFqnToConfig", "AOPerModuleConfig"):
        raise UsageError(f"{where}: a layer's config cannot itself be a per-layer table")
    return spec


def fqn_table(base: Any, table: LayerTable) -> Any:
    """The component's config: ``FqnToConfig`` with the file's entries, then ``_default`` = ``base``."""
    import warnings

    from torchao.quantization import FqnToConfig

    entries: dict[str, Any] = dict.fromkeys(table.guards)
    entries.update({k: (s.config if s else None) for k, s in table.entries})
    entries["_default"] = base
    with warnings.catch_warnings():  # torchao 0.18 announces that _default is deprecated; both libraries read it
        warnings.simplefilter("ignore", UserWarning)
        return FqnToConfig(entries)


def leaf_configs(config: Any) -> list[Any]:
    """The plain configs an ``FqnToConfig`` holds (the config itself otherwise), None entries left out."""
    table = getattr(config, "fqn_to_config", None)
    if type(config).__name__ in ("FqnToConfig", "ModuleFqnToConfig", "AOPerModuleConfig") and isinstance(table, Mapping):
        return [c for c in table.values() if c is not None]
    return [config]
