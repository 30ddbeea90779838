"""The card's config section and hardware table: the configs exactly as given, as stored, the Python that builds
them (``PipelineQuantizationConfig(quant_mapping=...)`` for a pipeline: diffusers' ``TorchAoConfig`` for diffusers
components, transformers' for text encoders; the ``quant_backend=`` form fails whenever transformers is installed),
and one hardware row per config, from what that config makes (configs/facts.py).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from publisher import adapters
from publisher.configs.facts import facts_for
from publisher.configs.render import canonical
from publisher.configs.syntax import imports_for
from publisher.handoffs.artifacts import Artifacts, QuantizedComponent
from publisher.recipes import Recipe

DEFAULT_WARNING = ("Loading it, torchao 0.18 warns `Config Deprecation: _default is deprecated` "
                   "([pytorch/ao#3229](https://github.com/pytorch/ao/issues/3229)): `_default` is how diffusers 0.42 and "
                   "transformers 5.23 read \"every other layer\" of an `FqnToConfig`, and both read it as written here")
BIAS_NOTE = ("The table stored for `{label}` starts with `{guards}`: transformers 5.23 applies an `FqnToConfig` entry "
             "(and `_default`) to every parameter of a Linear it matches, its bias included (measured: a Qwen2 "
             "`q_proj.bias` became an `Int8Tensor`), so these entries keep the biases as they are and only weights are "
             "quantized, as the file asks")


@dataclass
class ConfigSection:
    given: str  # the --quant value as given (shell-quoted)
    layer_files: list[dict[str, str]] = field(default_factory=list)  # component, origin, JSON as given
    stored: list[dict[str, str]] = field(default_factory=list)  # component, JSON of quant_type as stored
    python: str = ""
    notes: list[str] = field(default_factory=list)
    rows: list[dict[str, str]] = field(default_factory=list)  # the hardware table, one row per config
    classes: list[str] = field(default_factory=list)  # every torchao class the configs made


def _expression(recipe: Recipe, component: str, variable: str) -> tuple[str, list[str]]:
    """(the config expression of ``component``, lines defining what it refers to)."""
    table = recipe.table_for(component)
    if table is None:
        return variable, []
    lines = [f"{variable}_layers = FqnToConfig({{"]
    lines += [f"    {json.dumps(g)}: None," for g in table.guards]
    lines += [f"    {json.dumps(k)}: {s.python if s else 'None'}," for k, s in table.entries]
    lines += [f'    "_default": {variable},', "})"]
    return f"{variable}_layers", lines


def python(recipe: Recipe, components: list[Any], kind: str, base: str, stored: dict[str, dict[str, Any]]) -> str:
    """The Python that builds this repo's quantization config, runnable as is; the comment line is the call that
    quantizes the base the same way (``components``: the quantized ones, stages.quantize.QuantizedComponent)."""

    specs = recipe.specs()
    torchao_names = {n for s in specs for n in s.names} | ({"FqnToConfig"} if recipe.layers else set())
    head = imports_for(tuple(sorted(torchao_names)), any(s.uses_torch for s in specs)) if all(s.call for s in specs) else (
        "\n".join(dict.fromkeys(line for s in specs for line in s.imports().splitlines() if line))
        + ("\nfrom torchao.quantization import FqnToConfig" if recipe.layers else ""))
    in_pipeline = kind == "pipeline"
    used = [adapters.of(library) for library in sorted({c.library for c in components})]
    plain = [line for line in head.splitlines() if line.startswith("import ") and line != "import torch"]  # json
    lines = [*plain, *([""] if plain else []), "import torch"]
    if in_pipeline:
        lines.append("from diffusers import DiffusionPipeline, PipelineQuantizationConfig" +
                     "".join(a.card_pipeline_names for a in used))
    lines += [line for line in head.splitlines() if line.startswith("from ")]
    if in_pipeline:
        lines += [a.card_pipeline_import for a in used if a.card_pipeline_import]
    else:
        lines.append(f"from transformers import {_auto(components[0])}, TorchAoConfig")
    body: list[str] = []
    variables: dict[str, str] = {}
    if recipe.quant.default is not None:
        body.append(f"config = {recipe.quant.default.python}")
        variables = {c.name: "config" for c in components}
    else:
        for name, spec in recipe.quant.mapping:
            variables[name] = f"{name}_config"
            body.append(f"{name}_config = {spec.python}")
    wrapped: dict[str, str] = {}
    for c in components:
        expr, extra = _expression(recipe, c.name, variables[c.name])
        if extra:
            body += extra
        skip = stored.get(c.name, {}).get("modules_to_not_convert")
        args = expr + (f", modules_to_not_convert={json.dumps(list(skip))}" if skip else "")
        cls = adapters.of(c.library).card_config_class(in_pipeline)
        wrapped[c.name] = f"{cls}({args})"
    if kind == "pipeline":
        body += ["quantization_config = PipelineQuantizationConfig(quant_mapping={",
                 *[f"    {json.dumps(n)}: {w}," for n, w in wrapped.items()], "})",
                 "# quantizes the base as this repo was made:",
                 f"# DiffusionPipeline.from_pretrained({json.dumps(base)}, quantization_config=quantization_config, "
                 "dtype=torch.bfloat16)"]
    else:
        body += [f"quantization_config = {next(iter(wrapped.values()))}", "# quantizes the base as this repo was made:",
                 f"# {_auto(components[0])}.from_pretrained({json.dumps(base)}, quantization_config=quantization_config, "
                 "dtype=torch.bfloat16)"]
    return "\n".join([*lines, "", *body])


def _auto(component: QuantizedComponent) -> str:
    return "AutoModelForCausalLM" if adapters.of(component.library).causal_lm(component.class_name) else "AutoModel"


def section(recipe: Recipe, artifacts: Artifacts, kind: str, base: str) -> ConfigSection:
    """Everything the card's config section and hardware table say, from the recipe and what was made."""
    comps = artifacts.components
    stored = {c.name: c.quantization_config for c in comps}
    given = "--quant " + shlex.quote(recipe.quant.given)
    out = ConfigSection(given=given, python=python(recipe, comps, kind, base, stored))
    for table in recipe.layers:
        label = table.component or "model"
        out.layer_files.append({"component": label, "origin": table.origin.rsplit("/", 1)[-1] if table.origin else "inline",
                                "json": table.given})
        if table.guards:
            out.notes.append(BIAS_NOTE.format(label=label, guards=", ".join(f'"{g}": null' for g in table.guards)))
    if recipe.layers:
        out.notes.append(DEFAULT_WARNING)
    for c in comps:
        quant_type = c.quantization_config.get("quant_type", c.quantization_config)
        out.stored.append({"component": c.label, "json": json.dumps(quant_type, indent=2, sort_keys=True)})
    out.rows = hardware_rows(recipe, comps)
    out.classes = sorted({cls for c in comps for cls in c.tensor_classes})
    return out


def hardware_rows(recipe: Recipe, comps: list[Any]) -> list[dict[str, str]]:
    """One row per config this repo applies: where (component and layer count), the tensor it made, its storage and
    its hardware (configs/facts.py)."""

    where: dict[str, dict[str, int]] = {}
    configs: dict[str, Any] = {}
    for c in comps:
        config = recipe.config_for(c.name)
        table = getattr(config, "fqn_to_config", None) if recipe.table_for(c.name) is not None else None
        for layer in c.quantized:
            leaf = adapters.of(c.library).resolve(table, f"{layer}.weight")[0] if table is not None else config
            if leaf is None:
                continue
            key = canonical(leaf)
            configs.setdefault(key, leaf)
            where.setdefault(key, {})
            where[key][c.label] = where[key].get(c.label, 0) + 1
    rows = []
    for key, leaf in configs.items():
        f = facts_for(leaf)
        spec = next((s for s in recipe.specs() if s.canonical == key), None)
        rows.append({
            "config": spec.python if spec is not None else type(leaf).__name__,
            "applies_to": "; ".join(f"{label}: {n} layer{'s' if n != 1 else ''}" for label, n in where[key].items()),
            "tensor": f.tensor_class, "storage": f.storage, "run": f.run.describe(), "speedup": f.speedup,
            "quantize": f.quantize.describe() + (" (hf-ao-publish makes it on a CPU too)" if f.cpu_producible else ""),
            "packages": ", ".join(f.run.packages) or "none",
        })
    return rows
