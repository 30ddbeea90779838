"""Hardware and storage facts of one torchao config, from the tensor it makes and the device rules.

What the tensor is comes from torchao itself: a throw-away Linear is quantized on this CPU (configs/probe.py) and
its class and stored bytes are read off the result. Where torchao cannot make it on a CPU, the device rules below say
what it needs instead (and the class it makes there). The rules are data, keyed by config class (and, for
``Int4WeightOnlyConfig``, by packing format), measured on our pins: docs/gpu.md (H200) and docs/cpu-int4.md (CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from publisher.configs import probe
from publisher.configs.render import canonical
from publisher.configs.syntax import first_line
from publisher.errors import UsageError

if TYPE_CHECKING:
    from publisher.flavors import Flavor

# torchao 0.18's safetensors support: the only tensor classes a published repo can hold
SAFETENSORS_CLASSES = frozenset({"Float8Tensor", "Int4Tensor", "Int4TilePackedTo4dTensor", "IntxUnpackedToInt8Tensor",
                                 "Int8Tensor", "Int4PlainInt32Tensor", "MXTensor", "NVFP4Tensor"})


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


def strictest(needs: Iterable[Needs]) -> Needs:
    """What a repo whose layers need each of ``needs`` needs as a whole."""
    out = Needs()
    for n in needs:
        if not n.cuda:
            continue
        cc = max(filter(None, (out.min_cc, n.min_cc)), default=None)
        out = Needs(True, cc, tuple(dict.fromkeys(out.packages + n.packages)))
    return out


@dataclass(frozen=True)
class Rule:
    """The device rule of a config class: where torchao makes it, where it runs, where it is fast."""

    quantize: Needs
    run: Needs
    speedup: str
    tensor_class: str = ""  # what it makes where torchao cannot make it on a CPU (GPU-only formats)
    bits: float = 8.0  # stored bits per weight where it cannot be probed here
    cpu_producible: bool = False  # publisher/fp8cpu.py makes torchao's GPU bytes on a CPU
    notes: tuple[str, ...] = ()


FP8 = Needs(cuda=True, min_cc=(8, 9))
INT4_CPU_SPEED = ("none: on a CPU 1.2-13x slower than bf16, eager or compiled (docs/cpu-int4.md); torchao's fast int4 "
                  "CPU kernels need packed layouts safetensors cannot hold in 0.18; GPUs not measured")
RULES: dict[str, Rule] = {
    "Int8WeightOnlyConfig": Rule(Needs(), Needs(), "any CUDA GPU (memory-bound layers); runs on CPU"),
    "Int8DynamicActivationInt8WeightConfig": Rule(Needs(), Needs(), "any CUDA GPU (int8 matmul kernels); runs on CPU"),
    "Float8WeightOnlyConfig": Rule(Needs(), Needs(), "memory savings on any GPU; no FP8 compute speed-up below compute "
                                                     "capability 8.9"),
    "Float8DynamicActivationFloat8WeightConfig": Rule(
        FP8, FP8, "CUDA compute capability >= 8.9 (Ada, Hopper, Blackwell) via torch._scaled_mm", "Float8Tensor",
        cpu_producible=True),
    "Float8StaticActivationFloat8WeightConfig": Rule(FP8, FP8, "CUDA compute capability >= 8.9 via torch._scaled_mm",
                                                     "Float8Tensor"),
    "IntxWeightOnlyConfig": Rule(Needs(), Needs(), INT4_CPU_SPEED),
    "Int8DynamicActivationIntxWeightConfig": Rule(Needs(), Needs(), INT4_CPU_SPEED),
    "Float8DynamicActivationInt4WeightConfig": Rule(Needs(True, (9, 0), ("mslk",)), Needs(True, (9, 0), ("mslk",)),
                                                    "H100-class GPUs with mslk", "Int4PreshuffledTensor", 4.0),
}
# Int4WeightOnlyConfig's layout (int4_packing_format) decides the tensor and the hardware
INT4_RULES: dict[str, Rule] = {
    "tile_packed_to_4d": Rule(Needs(True, (8, 0)), Needs(True, (8, 0)), "CUDA compute capability >= 8.0 (tinygemm "
                              "kernels), bfloat16 only", "Int4TilePackedTo4dTensor", 4.25),
    "plain": Rule(Needs(True, None, ("mslk",)), Needs(True, None, ("mslk",)), "CUDA GPUs with the mslk kernels",
                  "Int4Tensor", 4.25),
    "preshuffled": Rule(Needs(True, (9, 0), ("mslk",)), Needs(True, (9, 0), ("mslk",)), "H100-class GPUs with mslk",
                        "Int4PreshuffledTensor", 4.25),
}
INT4_RULES["tile_packed_to_4d"] = replace(INT4_RULES["tile_packed_to_4d"], notes=(
    "Linear layers whose in_features is not a multiple of the group size are left unquantized.",))
UNKNOWN_SPEED = "not measured by hf-ao-publish; verification ran it on the machine that made it"


@dataclass(frozen=True)
class Facts:
    """What one leaf config (no FqnToConfig) makes, where, and how big it is."""

    config: str  # its class name
    tensor_class: str
    quantize: Needs
    run: Needs
    speedup: str
    bits: float  # stored bits per weight value, all parts counted
    storage: str  # how the values are stored, for the card
    cpu_producible: bool = False
    notes: tuple[str, ...] = ()
    probed: bool = True  # False: from the device rules only (torchao cannot make it on this CPU)


def rule_for(config: Any) -> Rule | None:
    name = type(config).__name__
    if name == "Int4WeightOnlyConfig":
        fmt = getattr(config, "int4_packing_format", "plain")
        return INT4_RULES.get(str(getattr(fmt, "value", fmt)))
    return RULES.get(name)


def rule_for_call(name: str, kwargs: dict[str, Any]) -> tuple[Needs, bool]:
    """(what quantizing needs, made on a CPU by fp8cpu) from a config's class and keyword arguments as text
    (configs/syntax.py ``check_shape``, or a ``config_to_dict`` object's ``_data``): the device rules without torchao,
    so a GPU-only config is refused before anything heavy is imported. The probe (``facts_for``) has the last word."""
    def text(v: Any) -> str:
        if isinstance(v, dict):  # config_to_dict: {"_type": "Int4PackingFormat", "_data": "TILE_PACKED_TO_4D"}
            v = v.get("_data", "")
        return str(v).rsplit(".", 1)[-1].lower()

    if name == "Int4WeightOnlyConfig":
        rule = INT4_RULES.get(text(kwargs.get("int4_packing_format", "plain")))
    else:
        rule = RULES.get(name)
    if rule is None:
        return Needs(), False
    granularity = kwargs.get("granularity")
    items = granularity if isinstance(granularity, list) else [granularity] if granularity is not None else []
    kinds = {(g.get("_type") if isinstance(g, dict) else str(g)) for g in items} or {"PerTensor"}
    fp8_cpu = rule.cpu_producible and len(kinds) == 1 and kinds <= {"PerRow", "PerTensor"}
    return rule.quantize, fp8_cpu


def facts_for(config: Any, what: str = "--quant") -> Facts:
    """The facts of one leaf config. UsageError when torchao rejects it on the probe, or when its tensors cannot be
    published (not in torchao's safetensors support)."""

    key = canonical(config)  # configs are not hashable; their JSON is their identity
    if key not in _CACHE:
        _CACHE[key] = _probe_facts(config, what)
    return _CACHE[key]


_CACHE: dict[str, Facts] = {}


def _probe_facts(config: Any, what: str) -> Facts:
    name = type(config).__name__
    rule = rule_for(config)
    needs_gpu = rule is not None and rule.quantize.cuda and not (rule.cpu_producible and _cpu_fp8_granularity(config))
    if needs_gpu:
        assert rule is not None
        storage = storage_text(rule.tensor_class, rule.bits, config) + " (from the device rules: not made on this CPU)"
        return _checked(Facts(name, rule.tensor_class, rule.quantize, rule.run, rule.speedup, rule.bits, storage, False,
                              rule.notes, probed=False), what)
    shape = probe.probe_shape(config)
    try:
        weight = probe.quantized_weight(config, shape)
    except (AssertionError, RuntimeError, ValueError, TypeError, ImportError, NotImplementedError, AttributeError) as exc:
        raise UsageError(f"{what}: torchao cannot quantize a {shape[0]}x{shape[1]} bfloat16 Linear with {name} on this "
                         f"CPU ({type(exc).__name__}: {first_line(exc)}); hf-ao-publish has no device rule saying which "
                         "hardware it needs, so it cannot be published here") from None
    cls = type(weight).__name__
    if cls in ("Parameter", "Tensor"):
        raise UsageError(f"{what}: {name} leaves a {shape[0]}x{shape[1]} bfloat16 Linear unquantized; there would be "
                         "nothing to publish")
    bits = probe.stored_bytes(weight) * 8 / (shape[0] * shape[1])
    if rule is None:
        rule = Rule(Needs(), Needs(), UNKNOWN_SPEED)
    notes = rule.notes + (("Per-row scaling wants bfloat16 weights.",) if _per_row_fp8(config) else ())
    storage = storage_text(cls, bits, config) + f" (measured on a {shape[0]}x{shape[1]} Linear)"
    return _checked(Facts(name, cls, rule.quantize, rule.run, rule.speedup, round(bits, 2), storage,
                          rule.cpu_producible, notes), what)


def _checked(facts: Facts, what: str) -> Facts:
    if facts.tensor_class not in SAFETENSORS_CLASSES:
        raise UsageError(f"{what}: {facts.config} makes {facts.tensor_class} weights, which torchao 0.18 cannot save "
                         f"as safetensors (it saves {', '.join(sorted(SAFETENSORS_CLASSES))}); choose another layout")
    return facts


def _granularities(config: Any) -> list[str]:
    g = getattr(config, "granularity", None)
    items = g if isinstance(g, (list, tuple)) else [g]
    return [type(x).__name__ for x in items if x is not None]


def _cpu_fp8_granularity(config: Any) -> bool:
    """fp8cpu makes PerRow / PerTensor (both activation and weight alike) only."""
    found = _granularities(config) or ["PerTensor"]
    return len(set(found)) == 1 and found[0] in ("PerRow", "PerTensor")


def _per_row_fp8(config: Any) -> bool:
    return type(config).__name__ == "Float8DynamicActivationFloat8WeightConfig" and "PerRow" in _granularities(config)


def storage_text(tensor_class: str, bits: float, config: Any) -> str:
    """How the weight values are stored, in words (the card says this next to the sizes)."""
    if tensor_class == "IntxUnpackedToInt8Tensor":
        dtype = str(getattr(config, "weight_dtype", "torch.int8")).replace("torch.", "")
        if dtype != "int8":
            return (f"{dtype} values stored unpacked, one per int8 byte, plus scales and zero points: about "
                    f"{bits:.2f} bits per weight, the size of int8, not of {dtype} (torchao 0.18 has no packed "
                    "format that a CPU can make and safetensors can hold)")
        return f"int8 values plus scales and zero points: about {bits:.2f} bits per weight"
    if tensor_class.startswith("Int4"):
        return f"two int4 values packed per byte plus group scales: about {bits:.2f} bits per weight"
    if tensor_class == "Float8Tensor":
        return f"float8 (e4m3) values plus scales: about {bits:.2f} bits per weight"
    if tensor_class == "Int8Tensor":
        return f"int8 values plus scales: about {bits:.2f} bits per weight"
    return f"about {bits:.2f} bits per weight"
