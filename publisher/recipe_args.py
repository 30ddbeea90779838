"""The recipes a command line asks for: ``--quant`` values (names, configs, per-component mappings) and
``--layer-config`` tables become ``recipes.Recipe`` objects, named, de-duplicated and bound to the components the plan
chose. ``precheck`` is the part that needs no torchao (it runs before anything heavy is imported).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from publisher import recipes
from publisher.configs.facts import rule_for_call, strictest
from publisher.configs.layers import LayerTable, parse_layer_arg, precheck_layer_arg
from publisher.configs.spec import ConfigSpec, Quant, from_config, parse_quant, precheck_quant
from publisher.errors import UsageError
from publisher.recipes import CALLS, PER_LAYER, Recipe

log = logging.getLogger(__name__)


def slug(spec: ConfigSpec) -> str:
    """``int8wo``; ``intx-weight-only`` for IntxWeightOnlyConfig(...)."""
    if spec.recipe:
        return spec.recipe
    name = type(spec.config).__name__.removesuffix("Config")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "-", name).lower()


def recipe_for(quant: Quant, layers: Sequence[LayerTable] = ()) -> Recipe:
    """The recipe of one --quant unit (and the run's --layer-config tables): a registry recipe keeps its name; anything
    else is named by a readable slug and a short digest of its configs."""
    if quant.default is not None and quant.default.recipe and not layers:
        return recipes.get(quant.default.recipe)
    for spec in quant.specs():
        if layers and type(spec.config).__name__ in PER_LAYER:
            raise UsageError(f"--quant {quant.given!r} is already a per-layer table; give the per-layer entries in one "
                             "place (it, or --layer-config)")
    parts = [slug(quant.default)] if quant.default else [f"{c}-{slug(s)}" for c, s in quant.mapping]
    text = "-".join(parts)[:56].strip("-_.") + ("-per-layer" if layers else "")
    identity = json.dumps({"quant": [[c, s.canonical] for c, s in quant.mapping] or [quant.default.canonical if quant.default else ""],
                           "layers": sorted(t.canonical() for t in layers)}, sort_keys=True)  # bound or not: one name
    name = f"{text}-{hashlib.sha256(identity.encode()).hexdigest()[:8]}"
    summary = (quant.default.given if quant.default else f"per component: {quant.given}")
    notes = tuple(n for s in quant.specs() if s.recipe for n in recipes.get(s.recipe).notes)
    return Recipe(name, summary, quant, tuple(layers), notes)


def precheck(values: Sequence[str], layer_values: Sequence[str] = (), *, check_hardware: bool = True
             ) -> list[tuple[str, ...]]:
    """What ``parse`` checks without importing torchao, so a misspelt name, a stray character or a GPU-only config on
    a CPU fails at once, before the base's own cheap checks and the seconds torchao takes to import (the device rules
    by config class: configs/facts.py ``rule_for_call``; torch is imported only to look for a GPU). Returns each
    unit's mapped components (empty: one config for every quantized component)."""

    if not values:
        raise UsageError("--quant is required; choose one of: " + ", ".join(recipes.names()) + ", or give a torchao config")
    tables = [precheck_layer_arg(v, CALLS) for v in layer_values]
    components = [c for c, _ in tables]
    if len(components) != len(set(components)):
        raise UsageError("--layer-config names the same component twice; give one file per component")
    units = precheck_quant(list(values), CALLS)
    for given, _, shapes in units if check_hardware else ():
        rules = [rule_for_call(n, kw) for n, kw in shapes + [s for _, t in tables for s in t]]
        gpu = [needs for needs, fp8_cpu in rules if needs.cuda and not fp8_cpu]
        if gpu:
            recipes.refuse_without_gpu(given if given in CALLS else f"--quant {given!r}", strictest(gpu))
    return [mapped for _, mapped, _ in units]


def parse(values: Sequence[str], layer_values: Sequence[str] = ()) -> list[Recipe]:
    """`--quant` values (and `--layer-config` values) as recipes: order kept, duplicates dropped with a warning."""
    layers = [parse_layer_arg(v, CALLS) for v in layer_values]
    seen_components = [t.component for t in layers]
    if len(seen_components) != len(set(seen_components)):
        raise UsageError("--layer-config names the same component twice; give one file per component")
    found: list[Recipe] = []
    for quant in parse_quant(list(values), CALLS):
        recipe = recipe_for(quant, layers)
        same = next((r for r in found if r.name == recipe.name), None)
        if same is None:
            found.append(recipe)
        elif same.quant.given != quant.given:  # the same text twice was said by precheck
            log.warning("--quant %s is the same config as %s; it is published once",
                                                quant.given, same.quant.given)
    if not found:
        raise UsageError("--quant is required; choose one of: " + ", ".join(recipes.names()) + ", or give a torchao config")
    for recipe in found:
        recipe.facts  # noqa: B018 - every config is probed now: one torchao rejects fails before anything else
    return found


def with_components(recipe: Recipe, components: Sequence[str]) -> Recipe:
    """The recipe with its per-layer tables bound to the component names the plan chose."""
    if not recipe.layers:
        return recipe
    tables = []
    for table in recipe.layers:
        if table.component is None:
            if len(components) != 1:
                raise UsageError(f"--layer-config {table.origin or 'JSON'} names no component and {len(components)} are "
                                 f"quantized ({', '.join(c or 'model' for c in components)}); write COMPONENT=FILE")
            table = replace(table, component=components[0])
        elif table.component not in components:
            raise UsageError(f"--layer-config {table.component}=: {table.component} is not a quantized component "
                             f"(quantized: {', '.join(c or 'model' for c in components)})")
        tables.append(table)
    return replace(recipe, layers=tuple(tables))


def from_configs(name: str, configs: dict[str, Any]) -> Recipe:
    """A recipe for configs declared by a checkpoint (verify TARGET): component -> its torchao config."""

    mapping = tuple((c, from_config(cfg, type(cfg).__name__, "declared")) for c, cfg in configs.items())
    return Recipe(name, "the declared quantization_config", Quant(name, mapping=mapping))
