"""What a config makes of one weight: a throw-away layer quantized with torchao's own ``quantize_``.

The one place that quantizes stand-in layers: the hardware facts of a config (configs/facts.py: which tensor class,
how many bytes) and the declared-config check of verify (verify/declared.py: what each stored layer must be) both
ask here, so they cannot disagree about what a config makes.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

from publisher.fp8cpu import allow_cpu_float8_quantization


def needs_fp8_bypass(config: Any) -> bool:
    """FP8 dynamic-activation configs: torchao refuses CPUs in their handler; publisher/fp8cpu.py lifts exactly that."""
    return type(config).__name__ == "Float8DynamicActivationFloat8WeightConfig"


def group_sizes(config: Any) -> list[int]:
    """Every group size a config (and the configs and granularities inside it) names."""
    import dataclasses

    found: list[int] = []

    def walk(v: Any, depth: int) -> None:
        if depth > 8:
            return
        if type(v).__name__ == "PerGroup":
            found.append(int(v.group_size))
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x, depth + 1)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for f in dataclasses.fields(v):
                value = getattr(v, f.name, None)
                if f.name == "group_size" and isinstance(value, int) and not isinstance(value, bool):
                    found.append(value)
                else:
                    walk(value, depth + 1)

    walk(config, 0)
    return [g for g in found if g > 0]


def probe_shape(config: Any, out_features: int = 256) -> tuple[int, int]:
    """A small Linear shape every group size of ``config`` divides (and tile layouts accept)."""
    size = 1024
    for g in group_sizes(config):
        size = size * g // math.gcd(size, g)
    return out_features, size


def quantized_weight(config: Any, shape: tuple[int, ...], dtype: str = "bfloat16", *, kind: str = "linear",
                     device: str = "cpu", every_module: bool = False) -> Any:
    """The weight of a throw-away ``kind`` ("linear" / "embedding") layer of ``shape`` and ``dtype`` after
    ``quantize_(layer, config)``: a torchao tensor, or the plain weight when torchao left the layer alone. Seeded
    random values (no 0/0 scales). ``every_module``: quantize_ with a filter that takes any module (transformers'
    call for an ``FqnToConfig`` entry); else quantize_'s default (Linear layers). Raises what torchao raises."""
    import torch
    from torchao.quantization import quantize_


    torch_dtype = getattr(torch, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        weight = torch.randn(shape, dtype=torch.float32).to(torch_dtype).to(device)
    module: Any = (torch.nn.Linear(shape[1], shape[0], bias=False, device="meta") if kind == "linear"
                   else torch.nn.Embedding(shape[0], shape[1], device="meta"))
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    extra = {"filter_fn": lambda m, fqn: True} if every_module else {}
    bypass = needs_fp8_bypass(config) and device == "cpu"
    with allow_cpu_float8_quantization() if bypass else nullcontext():
        quantize_(module, config, **extra)
    return module.weight


def stored_bytes(weight: Any) -> int:
    """Bytes the weight takes in safetensors: every flattened part (qdata, scale, zero point...)."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    flat, _ = flatten_tensor_state_dict({"p.weight": weight.detach()})
    return sum(t.numel() * t.element_size() for t in flat.values())
