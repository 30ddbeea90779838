"""The recipe registry: one place that names every quantization recipe we publish.

It feeds the CLI choices and `hf-ao-publish recipes` (text and --json, both from ``Recipe.to_dict``),
the hardware check, the model card and the test parametrisation. A recipe is data (which torchao
config, what hardware it needs to quantize and to run); which library versions read its output is measured
on every publish (the compatibility matrix beside it, publisher/compat.py), never stated here;
`build_config` turns it into a torchao ``AOBaseConfig``.
The config is written as Python source once (``imports`` + ``expression``) so the card shows
exactly the code that built it; a unit test checks the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from publisher import flavors as flavor_table
from publisher.errors import HardwareError, UsageError
from publisher.flavors import Flavor


@dataclass(frozen=True)
class Needs:
    """Hardware a step needs. ``cuda=False`` means a CPU is enough."""

    cuda: bool = False
    min_cc: tuple[int, int] | None = None  # minimum CUDA compute capability
    packages: tuple[str, ...] = ()  # extra kernel packages (pip names)

    def describe(self) -> str:
        if not self.cuda:
            return "CPU or any GPU"
        text = "CUDA GPU"
        if self.min_cc:
            text += f" with compute capability >= {self.min_cc[0]}.{self.min_cc[1]}"
        if self.packages:
            text += " and " + ", ".join(self.packages)
        return text

    def fits(self, flavor: Flavor) -> bool:
        """True when a Jobs flavor offers this (a CPU flavor fits only what needs no GPU)."""
        if not self.cuda:
            return True
        cc = flavor.capability
        return cc is not None and (self.min_cc is None or cc >= self.min_cc)

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": not self.cuda, "gpu_min_cc": ".".join(map(str, self.min_cc)) if self.min_cc else None,
                "packages": list(self.packages), "text": self.describe()}


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    imports: str
    expression: str
    tensor_class: str  # torchao tensor subclass every quantized Linear weight must be
    quantize: Needs  # what torchao's own handler needs (see cpu_producible)
    run: Needs
    speedup: str  # where it runs with real speed-ups (card's hardware table)
    bits: int  # bits per stored weight value (for size estimates)
    notes: tuple[str, ...] = ()
    # True when publisher/fp8cpu.py can produce the exact tensors torchao builds on a GPU, on a CPU.
    cpu_producible: bool = False

    @property
    def python(self) -> str:
        """The Python that builds this recipe's torchao config (shown in the card)."""
        return f"{self.imports}\n\nconfig = {self.expression}"

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

    def to_dict(self, flavors: Sequence[Flavor] | None = None) -> dict[str, Any]:
        """Everything `hf-ao-publish recipes` shows (its text and its --json); ``flavors``: the Jobs
        hardware to pick from (the Hub's list; default: the built-in table)."""
        return {
            "name": self.name,
            "summary": self.summary,
            "config": self.python,
            "tensor_class": self.tensor_class,
            "bits": self.bits,
            "quantize_on": {**self.quantize.to_dict(), "cpu": not self.needs_gpu_to_quantize, "text": self.quantize_on},
            "run_on": self.run.to_dict(),
            "speedup": self.speedup,
            "notes": list(self.notes),
            "hf_jobs": {step: [f.name for f in found] for step, found in self.smallest_flavors(flavors).items()},
        }


_REGISTRY: dict[str, Recipe] = {}


def _register(recipe: Recipe) -> Recipe:
    _REGISTRY[recipe.name] = recipe
    return recipe


_register(Recipe(
    name="int8wo",
    summary="int8 weight-only, per-row scales",
    imports="from torchao.quantization import Int8WeightOnlyConfig",
    expression="Int8WeightOnlyConfig()",
    tensor_class="Int8Tensor",
    quantize=Needs(),
    run=Needs(),
    speedup="any CUDA GPU (memory-bound layers); runs on CPU",
    bits=8,
))
_register(Recipe(
    name="int8dq",
    summary="int8 dynamic activations + int8 weights",
    imports="from torchao.quantization import Int8DynamicActivationInt8WeightConfig",
    expression="Int8DynamicActivationInt8WeightConfig()",
    tensor_class="Int8Tensor",
    quantize=Needs(),
    run=Needs(),
    speedup="any CUDA GPU (int8 matmul kernels); runs on CPU",
    bits=8,
))
_register(Recipe(
    name="float8wo",
    summary="float8 (e4m3) weight-only",
    imports="from torchao.quantization import Float8WeightOnlyConfig",
    expression="Float8WeightOnlyConfig()",
    tensor_class="Float8Tensor",
    quantize=Needs(),
    run=Needs(),
    speedup="memory savings on any GPU; no FP8 compute speed-up below compute capability 8.9",
    bits=8,
))
_register(Recipe(
    name="float8dq",
    summary="float8 dynamic activations + float8 weights, per-row scales",
    imports="from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow",
    expression="Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())",
    tensor_class="Float8Tensor",
    quantize=Needs(cuda=True, min_cc=(8, 9)),
    run=Needs(cuda=True, min_cc=(8, 9)),
    speedup="CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell) via torch._scaled_mm",
    bits=8,
    notes=("Per-row scaling wants bfloat16 weights.",),
    cpu_producible=True,
))
_register(Recipe(
    name="float8dq-tensor",
    summary="float8 dynamic activations + float8 weights, per-tensor scales",
    imports="from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor",
    expression="Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor())",
    tensor_class="Float8Tensor",
    quantize=Needs(cuda=True, min_cc=(8, 9)),
    run=Needs(cuda=True, min_cc=(8, 9)),
    speedup="CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell) via torch._scaled_mm",
    bits=8,
    cpu_producible=True,
))
_register(Recipe(
    name="int4wo",
    summary="int4 weight-only, group size 128, HQQ qparams, tinygemm tile-packed layout",
    imports="from torchao.quantization import Int4WeightOnlyConfig",
    expression=(
        'Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d", '
        'int4_choose_qparams_algorithm="hqq")'
    ),
    tensor_class="Int4TilePackedTo4dTensor",
    quantize=Needs(cuda=True, min_cc=(8, 0)),
    run=Needs(cuda=True, min_cc=(8, 0)),
    speedup="CUDA compute capability >= 8.0 (tinygemm kernels), bfloat16 only",
    bits=4,
    notes=("Linear layers whose in_features is not a multiple of 128 are left unquantized.",),
))


def names() -> list[str]:
    return list(_REGISTRY)


def all_recipes() -> list[Recipe]:
    return list(_REGISTRY.values())


def get(name: str) -> Recipe:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"unknown recipe {name!r}; choose one of: {', '.join(_REGISTRY)} "
            "(see `hf-ao-publish recipes`)"
        ) from None


def build_config(recipe: Recipe) -> Any:
    """Build the torchao AOBaseConfig by running the recipe's own Python (registry data, not user input)."""
    namespace: dict[str, Any] = {}
    exec(recipe.imports, namespace)  # noqa: S102 - constant source from this module
    return eval(recipe.expression, namespace)  # noqa: S307 - constant source from this module


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, or None without a usable GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def quantize_device(recipe: Recipe, capability: tuple[int, int] | None) -> str:
    """Where the weights are quantized: "cuda" when the recipe needs a GPU and one fits, else "cpu"
    (CPU recipes, and FP8 recipes through the bit-exact CPU path of publisher/fp8cpu.py)."""
    needs = recipe.quantize
    if needs.cuda and capability is not None and (not needs.min_cc or capability >= needs.min_cc):
        return "cuda"
    return "cpu"


def run_device(recipe: Recipe, capability: tuple[int, int] | None) -> str:
    """Where verification runs the reloaded model: the GPU when the recipe needs one to run and one fits."""
    needs = recipe.run
    if needs.cuda and capability is not None and (not needs.min_cc or capability >= needs.min_cc):
        return "cuda"
    return "cpu"


def check_can_quantize(recipe: Recipe, capability: tuple[int, int] | None = None, *, probe: bool = True) -> None:
    """Fail before any download when this machine cannot quantize with ``recipe``."""
    needs = recipe.quantize
    if not recipe.needs_gpu_to_quantize:
        return
    cc = capability if capability is not None or not probe else cuda_capability()
    if cc is None:
        raise HardwareError(
            f"{recipe.name} needs a {needs.describe()} to quantize, and this machine has none; "
            "run it on such a GPU or pick a CPU recipe "
            f"({', '.join(r.name for r in all_recipes() if not r.needs_gpu_to_quantize)})"
        )
    if needs.min_cc and cc < needs.min_cc:
        raise HardwareError(
            f"{recipe.name} needs a {needs.describe()} to quantize; this GPU has {cc[0]}.{cc[1]}"
        )


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
