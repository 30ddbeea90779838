"""The recipe registry, and what one publish makes: a ``Recipe`` is the torchao config (or one per component, and
per-layer tables) of one target repo.

Named recipes are entries written in torchao's call syntax and read like any user's config (configs/syntax.py: an
AST reader, never eval). Everything downstream follows the configs, not the name: the tensor class, the hardware to
make and run it, the stored size and the speed-up text come from configs/facts.py (the tensor torchao makes of a
throw-away Linear, and the device rules); which library versions read the output is measured on every publish (the
compatibility matrix, publisher/compat.py), never stated here. The registry feeds the CLI choices and
`hf-ao-publish recipes` (text and --json, both from ``Recipe.to_dict``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from publisher import flavors as flavor_table
from publisher.configs.facts import Facts, Needs, facts_for, rule_for_call, strictest
from publisher.configs.layers import LayerTable, fqn_table, leaf_configs
from publisher.configs.render import canonical
from publisher.configs.spec import ConfigSpec, Quant, parse_quant
from publisher.configs.syntax import check_shape, imports_for
from publisher.errors import HardwareError, UsageError
from publisher.flavors import Flavor

__all__ = ["Entry", "Needs", "Recipe", "all_recipes", "get", "names"]


@dataclass(frozen=True)
class Entry:
    """A named recipe: a config in torchao's call syntax, with a summary and notes for the listing and the card."""

    name: str
    summary: str
    config: str
    notes: tuple[str, ...] = ()


ENTRIES: tuple[Entry, ...] = (
    Entry("int8wo", "int8 weight-only, per-row scales", "Int8WeightOnlyConfig()"),
    Entry("int8dq", "int8 dynamic activations + int8 weights", "Int8DynamicActivationInt8WeightConfig()"),
    Entry("float8wo", "float8 (e4m3) weight-only", "Float8WeightOnlyConfig()"),
    Entry("float8dq", "float8 dynamic activations + float8 weights, per-row scales",
          "Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())"),
    Entry("float8dq-tensor", "float8 dynamic activations + float8 weights, per-tensor scales",
          "Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor())"),
    Entry("int4wo", "int4 weight-only, group size 128, HQQ qparams, tinygemm tile-packed layout",
          'Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d", int4_choose_qparams_algorithm="hqq")'),
    Entry("intx4wo", "int4 weight-only, group size 32, made and run on a CPU (values stored unpacked in int8)",
          "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))",
          ("The int4 values are stored one per int8 byte: the files are about the size of int8 (8.75 bits per weight "
           "with the group scales and zero points), not half of it.",
           "Linear layers whose in_features is not a multiple of 32 cannot take it: exclude them (--exclude, or null in "
           "--layer-config).")),
    Entry("int8dq-int4", "int8 dynamic activations + int4 weights, group size 32, made and run on a CPU "
          "(values stored unpacked in int8)",
          "Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))",
          ("The int4 values are stored one per int8 byte: the files are about the size of int8, not half of it.",
           "Linear layers whose in_features is not a multiple of 32 cannot take it: exclude them (--exclude, or null in "
           "--layer-config).")),
)
_ENTRIES = {e.name: e for e in ENTRIES}
CALLS = {e.name: e.config for e in ENTRIES}  # what configs/spec.py resolves a name to
PER_LAYER = ("FqnToConfig", "ModuleFqnToConfig", "AOPerModuleConfig")


@dataclass(frozen=True)
class Recipe:
    """The configs of one published repo. ``quant``: one config for every quantized component, or one per component;
    ``layers``: per-layer tables, by component (applied on top of that component's config)."""

    name: str
    summary: str
    quant: Quant
    layers: tuple[LayerTable, ...] = ()
    notes: tuple[str, ...] = ()

    # ---- the configs ------------------------------------------------------------------------------------------
    @property
    def named(self) -> bool:
        """A registry recipe, as the registry has it (no per-layer table, no mapping)."""
        return self.name in _ENTRIES and not self.layers and self.quant.default is not None

    @property
    def per_component(self) -> bool:
        return bool(self.quant.mapping)

    def table_for(self, component: str) -> LayerTable | None:
        return next((t for t in self.layers if t.component in (component, None)), None)

    def config_for(self, component: str = "") -> Any:
        """The torchao config ``component`` is quantized with (an ``FqnToConfig`` when it has a per-layer table)."""
        base = self.quant.for_component(component).config
        table = self.table_for(component)
        return fqn_table(base, table) if table is not None else base

    def specs(self) -> list[ConfigSpec]:
        """Every config this recipe names, per-layer entries included (None entries left out)."""
        found = self.quant.specs() + [s for t in self.layers for _, s in t.entries if s is not None]
        return list({s.canonical: s for s in found}.values())

    @functools.cached_property
    def facts(self) -> list[Facts]:
        """The facts of every plain config this recipe applies (configs/facts.py), one per distinct config."""

        leaves = {canonical(c): c for s in self.specs() for c in leaf_configs(s.config)}
        return [facts_for(c, f"--quant {self.summary}") for c in leaves.values()]

    def classes_for(self, component: str = "") -> tuple[str, ...]:
        """The torchao classes ``component``'s config(s) make."""

        leaves = {canonical(c): c for c in leaf_configs(self.config_for(component))}
        return tuple(sorted({facts_for(c).tensor_class for c in leaves.values()}))

    # ---- what the configs need and make -----------------------------------------------------------------------
    @property
    def tensor_classes(self) -> tuple[str, ...]:
        return tuple(sorted({f.tensor_class for f in self.facts}))

    @property
    def tensor_class(self) -> str:
        """The torchao class of every quantized weight when there is one; "" when layers differ (per layer)."""
        classes = self.tensor_classes
        return classes[0] if len(classes) == 1 else ""

    @property
    def quantize(self) -> Needs:
        return strictest(f.quantize for f in self.facts)

    @property
    def run(self) -> Needs:
        return strictest(f.run for f in self.facts)

    @property
    def cpu_producible(self) -> bool:
        """True when every config that torchao makes only on a GPU is one publisher/fp8cpu.py makes on a CPU."""
        gpu = [f for f in self.facts if f.quantize.cuda]
        return bool(gpu) and all(f.cpu_producible for f in gpu)

    @property
    def speedup(self) -> str:
        texts = list(dict.fromkeys(f.speedup for f in self.facts))
        if len(texts) == 1:
            return texts[0]
        return "; ".join(f"{f.config}: {f.speedup}" for f in self.facts)

    @property
    def bits(self) -> float:
        """Stored bits per quantized weight (the largest of its configs: the size estimates must not fall short)."""
        return max((f.bits for f in self.facts), default=16.0)

    @property
    def all_notes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.notes + tuple(n for f in self.facts for n in f.notes)))

    @property
    def title(self) -> str:
        """What the card's title calls it: the recipe name, else the config class(es)."""
        if self.named:
            return self.name
        what = (self.quant.default.label if self.quant.default else
                ", ".join(f"{c}: {s.label}" for c, s in self.quant.mapping))
        return what + (" with per-layer configs" if self.layers else "")

    # ---- the Python that builds it ----------------------------------------------------------------------------
    @property
    def expression(self) -> str:
        """The config as call syntax (one line per component for a mapping)."""
        if self.quant.default is not None:
            return self.quant.default.python
        return ", ".join(f"{c}={s.python}" for c, s in self.quant.mapping)

    @property
    def python(self) -> str:
        """The Python that builds this recipe's torchao config(s), imports first."""

        specs = self.quant.specs()
        if all(s.call for s in specs):
            head = imports_for(tuple(n for s in specs for n in s.names), any(s.uses_torch for s in specs))
        else:
            head = "\n".join(dict.fromkeys(line for s in specs for line in s.imports().splitlines() if line))
        if self.quant.default is not None:
            body = f"config = {self.quant.default.python}"
        else:
            body = "\n".join(f"{_variable(c)} = {s.python}" for c, s in self.quant.mapping)
        return f"{head}\n\n{body}"

    @property
    def needs_gpu_to_quantize(self) -> bool:
        """True when this machine needs a fitting GPU to produce the recipe (FP8 recipes do not: fp8cpu)."""
        return self.quantize.cuda and not self.cpu_producible

    @property
    def quantize_on(self) -> str:
        """Where hf-ao-publish can produce (quantize and save) this recipe, in words."""
        if self.cpu_producible:
            return (f"CPU or any GPU (torchao alone needs a {self.quantize.describe()}; "
                    "without one, hf-ao-publish quantizes on the CPU)")
        return self.quantize.describe()

    @property
    def job_needs(self) -> dict[str, Needs]:
        """What a Hugging Face Jobs flavor must offer for each step of a publish run there: quantize
        (FP8 is made on a CPU too), run (the verification's forward) and benchmark (--benchmark measures
        where verification runs: the GPU for recipes that need one, the CPU otherwise)."""
        quantize = self.quantize if self.needs_gpu_to_quantize else Needs()
        return {"quantize": quantize, "run": self.run, "benchmark": self.run}

    def smallest_flavors(self, flavors: Sequence[Flavor] | None = None, count: int = 2) -> dict[str, list[Flavor]]:
        """Per step (quantize, run, benchmark), the ``count`` smallest fitting flavors (``flavors`` in the
        order to prefer them, smallest or cheapest first; default: the built-in table)."""
        table = flavor_table.BUILTIN if flavors is None else flavors
        return {step: [f for f in table if needs.fits(f)][:count] for step, needs in self.job_needs.items()}

    def hf_jobs_text(self, flavors: Sequence[Flavor] | None = None) -> str:
        """`quantize: cpu-basic, cpu-upgrade; run, benchmark: l4x1 (L4, CC 8.9), ...` (steps with the same
        flavors share one entry)."""
        groups: dict[tuple[str, ...], list[str]] = {}
        for step, found in self.smallest_flavors(flavors).items():
            groups.setdefault(tuple(f.describe() for f in found), []).append(step)
        return "; ".join(f"{', '.join(steps)}: {', '.join(names) or 'no flavor fits'}" for names, steps in groups.items())

    def job_args(self) -> list[str]:
        """``--quant`` (and ``--layer-config``) for a command run elsewhere (Hugging Face Jobs): no local file named,
        every config as its call text, or its JSON inline."""
        def portable(s: ConfigSpec) -> str:
            return s.recipe or s.call or s.canonical

        quant = (portable(self.quant.default) if self.quant.default is not None else
                 ",".join(f"{c}={portable(s)}" for c, s in self.quant.mapping))
        return ["--quant", quant, *[a for t in self.layers for a in ("--layer-config", t.inline())]]

    def quant_json(self) -> dict[str, Any]:
        """The configs as given and as torchao writes them (the state file, --json)."""
        return {"given": self.quant.given,
                "components": ({c: s.to_json() for c, s in self.quant.mapping} if self.quant.mapping
                               else {"*": self.quant.default.to_json()} if self.quant.default else {}),
                "layers": [t.to_json() for t in self.layers]}

    def to_dict(self, flavors: Sequence[Flavor] | None = None) -> dict[str, Any]:
        """Everything `hf-ao-publish recipes` shows (its text and its --json); ``flavors``: the Jobs
        hardware to pick from (the Hub's list; default: the built-in table)."""
        return {
            "name": self.name,
            "summary": self.summary,
            "config": self.python,
            "tensor_class": self.tensor_class or ", ".join(self.tensor_classes),
            "bits": self.bits,
            "storage": "; ".join(dict.fromkeys(f.storage for f in self.facts)),
            "quantize_on": {**self.quantize.to_dict(), "cpu": not self.needs_gpu_to_quantize, "text": self.quantize_on},
            "run_on": self.run.to_dict(),
            "speedup": self.speedup,
            "notes": list(self.all_notes),
            "hf_jobs": {step: [f.name for f in found] for step, found in self.smallest_flavors(flavors).items()},
        }


def _variable(component: str) -> str:
    return f"{component}_config" if component.isidentifier() else "config"


def _named(entry: Entry) -> Recipe:
    quant = parse_quant([entry.name], CALLS)[0]
    return Recipe(entry.name, entry.summary, quant, notes=entry.notes)


@functools.lru_cache(maxsize=1)
def _registry() -> dict[str, Recipe]:
    return {e.name: _named(e) for e in ENTRIES}


def names() -> list[str]:
    return [e.name for e in ENTRIES]


def all_recipes() -> list[Recipe]:
    return list(_registry().values())


def get(name: str) -> Recipe:
    if name not in _ENTRIES:
        raise UsageError(f"unknown recipe {name!r}; choose one of: {', '.join(names())} (see `hf-ao-publish recipes`)")
    return _registry()[name]


def build_config(recipe: Recipe, component: str = "") -> Any:
    """The torchao AOBaseConfig ``component`` is quantized with (read from call syntax or JSON, never evaluated)."""
    return recipe.config_for(component)


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without a usable GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def device(recipe: Recipe, capability: tuple[int, int] | None) -> str:
    """Where the recipe's weights are quantized and where verification runs what they make: "cuda" when the recipe
    needs a GPU and one fits, else "cpu" (CPU recipes, and FP8 recipes through the bit-exact CPU path of
    publisher/fp8cpu.py). One rule for both steps: every device rule (configs/facts.py) asks the same GPU of
    quantizing as of running, since torchao's GPU-only tensors are made by the kernels that run them; a test holds
    the rules to it."""
    needs = recipe.run
    return "cuda" if needs.cuda and capability is not None and (not needs.min_cc or capability >= needs.min_cc) else "cpu"


def check_can_quantize(recipe: Recipe, capability: tuple[int, int] | None = None, *, probe: bool = True) -> None:
    """Fail before any download when this machine cannot quantize with ``recipe``."""
    if recipe.needs_gpu_to_quantize:
        refuse_without_gpu(recipe.name, recipe.quantize, capability, probe=probe)


def refuse_without_gpu(name: str, needs: Needs, capability: tuple[int, int] | None = None, *, probe: bool = True) -> None:
    cc = capability if capability is not None or not probe else cuda_capability()
    if cc is None:
        cpu = [e.name for e in ENTRIES if not _rule_needs_gpu(e.config)]
        raise HardwareError(f"{name} needs a {needs.describe()} to quantize, and this machine has none; {_on_jobs(needs)}"
                            f"run it on such a GPU, or pick a CPU recipe ({', '.join(cpu)})")
    if needs.min_cc and cc < needs.min_cc:
        raise HardwareError(f"{name} needs a {needs.describe()} to quantize; this GPU has {cc[0]}.{cc[1]}; "
                            f"{_on_jobs(needs)}or run it on a GPU that has it")


def _on_jobs(needs: Needs) -> str:
    """The Hugging Face Jobs way out of a missing GPU, with the two smallest flavors that have it ("": none has)."""
    fitting = [f.name for f in flavor_table.BUILTIN if needs.fits(f)][:2]
    if not fitting:
        return ""
    return (f"add --on-hf-jobs FLAVOR to run it on Hugging Face Jobs ({' or '.join(fitting)}; `hf-ao-publish recipes` "
            "lists the flavors), ")


def _rule_needs_gpu(call: str) -> bool:
    needs, fp8_cpu = rule_for_call(*check_shape(call))
    return needs.cuda and not fp8_cpu


def cpu_producible_names() -> tuple[str, ...]:
    """The FP8 dynamic-activation recipes publisher/fp8cpu.py makes on a CPU."""
    return tuple(r.name for r in all_recipes() if r.cpu_producible)


def hf_jobs_table(flavors: Sequence[Flavor] | None = None) -> str:
    """The Markdown table of docs/hf-jobs.md: recipes with the same smallest Jobs flavors share a row."""
    def cell(found: list[Flavor]) -> str:
        return ", ".join(f"`{f.name}`" + (f.describe()[len(f.name):] if f.gpu else "") for f in found) or "none"

    rows: dict[tuple[str, ...], list[str]] = {}
    for recipe in all_recipes():
        picks = recipe.smallest_flavors(flavors)
        rows.setdefault(tuple(cell(picks[step]) for step in ("quantize", "run", "benchmark")), []).append(f"`{recipe.name}`")
    lines = ["| recipe | quantize | run (verification's forward) | benchmark (`--benchmark`) |", "|---|---|---|---|"]
    lines += [f"| {', '.join(names)} | {' | '.join(cells)} |" for cells, names in rows.items()]
    return "\n".join(lines)
