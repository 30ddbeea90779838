"""Plan-time checks of a recipe's configs against the quantized components' layers, before any weight is read.

- ``bind``: per-layer tables get their component, and (transformers) the guard entries that keep biases alone;
- ``check``: every per-layer key names a Linear layer (or a pattern matches one), no entry makes transformers quantize
  a parameter that is not a Linear weight, and every layer the library will quantize can take its config: one
  throw-away Linear of each distinct shape is quantized on the meta device (on the CPU when the config's algorithm
  needs values), so a group size that does not divide a layer's in_features is named here, not after the download.
  A config that cannot be applied one Linear at a time is therefore said here too, for every engine.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from typing import Any

from publisher import adapters, recipe_args
from publisher.configs.facts import facts_for
from publisher.configs.layers import LayerTable
from publisher.configs.probe import quantized_weight
from publisher.configs.render import canonical
from publisher.configs.syntax import first_line
from publisher.errors import UsageError
from publisher.handoffs.plan import Component
from publisher.recipes import Recipe

log = logging.getLogger(__name__)

BIAS_GUARD = r"re:.*\.bias"  # an FqnToConfig key transformers reads before the user's patterns: biases stay as they are
SHOWN = 3


def bind(recipe: Recipe, quantized: list[Any]) -> Recipe:
    """``recipe`` with its per-layer tables bound to the components they apply to. transformers 5.23 applies an
    ``FqnToConfig`` entry (and ``_default``) to every parameter of a matched Linear, its bias included (measured:
    Qwen2's q_proj.bias became an Int8Tensor); the table of a transformers component whose Linear layers have biases
    therefore starts with ``re:.*\\.bias: None``, and an exact module key gets its ``.bias`` set to None."""
    bound = recipe_args.with_components(recipe, [c.name for c in quantized])
    tables = []
    for table in bound.layers:
        comp = next(c for c in quantized if c.name == table.component)
        guards: list[str] = []
        if adapters.of(comp.library).entries_apply_to_whole_module:
            biased = {p.rsplit(".", 1)[0] for p in comp.param_names if p.endswith(".bias")}
            if biased & set(comp.linear_names):
                guards.append(BIAS_GUARD)
                guards += [f"{k}.bias" for k, _ in table.entries if k in biased]
        tables.append(replace(table, guards=tuple(guards)))
    return replace(bound, layers=tuple(tables))


def _excluded(comp: Component, module: str, exclude: list[str]) -> bool:
    """Whether the library keeps ``module`` out of quantization (--exclude, and its default skips: the plan's
    ``default_skips``, empty where the library has none)."""
    return adapters.of(comp.library).kept(f"{module}.weight", sorted(set(exclude) | set(comp.default_skips)))


def check_table(comp: Component, table: LayerTable) -> None:
    """Every key of the file names a Linear layer of ``comp`` (a pattern matches at least one), and no entry makes
    transformers quantize a parameter other than a Linear weight."""
    linears = set(comp.linear_names)
    where = f"--layer-config {table.origin or 'JSON'} ({comp.label})"
    for key, _ in table.entries:
        if key.startswith("re:"):
            pattern = re.compile(key[3:])
            if not any(pattern.fullmatch(n) or pattern.fullmatch(f"{n}.weight") for n in linears):
                hint = ", ".join(sorted(linears)[:2])
                raise UsageError(f"{where}: pattern {key!r} matches no Linear layer (the whole fqn must match, e.g. "
                                 f"{hint}); fix the pattern")
            continue
        module = key.removesuffix(".weight")
        if module not in linears:
            import difflib

            close = difflib.get_close_matches(module, sorted(linears), n=1)
            what = "is not a Linear layer" if module in comp.module_names else "names no module"
            raise UsageError(f"{where}: {key!r} {what} of {comp.class_name}"
                             + (f" (did you mean {close[0]!r}?)" if close else "")
                             + "; per-layer configs apply to nn.Linear layers")
    library = adapters.of(comp.library)
    table_map = {k: (s.config if s else None) for k, s in table.entries}
    guards = dict.fromkeys(table.guards)
    used = {library.resolve_key({**guards, **table_map}, f"{n}.weight") for n in linears}
    idle = [k for k in table_map if k not in used]
    if idle:
        raise UsageError(f"{where}: entry {idle[0]!r} applies to no layer: every layer it matches takes an earlier or "
                         f"more exact entry ({library.pattern_order}, exact names first); reorder or narrow the entries")
    # Both libraries write config.json with sorted keys, so the stored table's patterns come back in sorted order: the
    # first matching pattern must be the same in both orders, or the stored config would not describe the files.
    ordered = {**guards, **table_map}
    by_name = dict(sorted(ordered.items()))
    for n in sorted(linears):
        given, stored = (library.resolve_key(t, f"{n}.weight") for t in (ordered, by_name))
        if given != stored:
            raise UsageError(f"{where}: layer {n} matches both {given!r} and {stored!r}; config.json stores the table with "
                             "sorted keys, so which pattern comes first would change; make the patterns disjoint")
    if not library.entries_apply_to_whole_module:
        return  # the library quantizes Linear weights only, whatever the table names
    for param in comp.param_names:
        module, _, leaf = param.rpartition(".")
        if leaf == "weight" and module in linears:
            continue
        config, why = library.resolve({**guards, **table_map}, param)
        if config is not None:
            raise UsageError(f"{where}: {why} also matches {param}, which {library.library} would then quantize (it applies "
                             "an entry to every parameter of the module it matches); narrow it to Linear layers")


def check(recipe: Recipe, quantized: list[Any], exclude: list[str]) -> None:
    """The module docstring's checks, for every quantized component of one recipe."""

    probes: dict[tuple[int, int, str], str | None] = {}
    for comp in quantized:
        table = recipe.table_for(comp.name)
        if table is not None:
            check_table(comp, table)
        config = recipe.config_for(comp.name)
        entries = getattr(config, "fqn_to_config", None) if table is not None else None
        bad: list[tuple[str, int, str]] = []
        for name, out_f, in_f in comp.linear_shapes:
            if _excluded(comp, name, exclude):
                continue
            leaf = adapters.of(comp.library).resolve(entries, f"{name}.weight")[0] if entries is not None else config
            if leaf is None or _gpu_only(leaf):
                continue
            key = (out_f, in_f, canonical(leaf))
            if key not in probes:
                probes[key] = _probe(leaf, (out_f, in_f))
            if probes[key] is not None:
                bad.append((name, in_f, str(probes[key])))
        if bad:
            first, in_f, said = bad[0]
            more = f" and {len(bad) - 1} more ({', '.join(b[0] for b in bad[1:SHOWN + 1])}{', ...' if len(bad) > SHOWN + 1 else ''})" if len(bad) > 1 else ""
            raise UsageError(
                f"{recipe.name}: layer {first} of {comp.label} (in_features {in_f}){more} cannot be quantized with its "
                f"config: torchao says {said}; leave such layers unquantized with --exclude {first} or a null entry in "
                "--layer-config, or choose a group size that divides them")


def _gpu_only(config: Any) -> bool:
    """Formats torchao makes only on a GPU: the hardware check refuses them on a CPU, and their layer rules (int4
    tinygemm leaves a non-multiple of its group size alone) are torchao's own, checked where they are made."""

    facts = facts_for(config)
    return facts.quantize.cuda


def _probe(config: Any, shape: tuple[int, int]) -> str | None:
    """None when torchao quantizes a ``shape`` Linear with ``config``; else what it said. On the meta device first
    (free); a config whose algorithm reads values (HQQ) is probed with real values on the CPU."""
    import torch
    from torchao.quantization import quantize_


    errors = (AssertionError, RuntimeError, ValueError, TypeError, NotImplementedError)
    try:
        module = torch.nn.Linear(shape[1], shape[0], bias=False, device="meta", dtype=torch.bfloat16)
        quantize_(module, config)
        return None
    except errors:
        pass
    try:
        quantized_weight(config, shape)
        return None
    except errors as exc:
        return f"{type(exc).__name__}: {first_line(exc)}"
