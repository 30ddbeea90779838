"""The library path of the quantize stage: ``from_pretrained`` with a ``TorchAoConfig``, then ``save_pretrained``
(components the streaming engine cannot handle, and ``--engine library``); what torchao did, counted from the model;
the FP8 error bound of FP8 weights made on a CPU, for both engines."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

from publisher import adapters
from publisher.errors import QuantizeError, VerificationError
from publisher.fp8cpu import check_dequantized, cpu_quantization_context
from publisher.handoffs.artifacts import QuantizedComponent
from publisher.handoffs.plan import Component, Plan
from publisher.io.jsonfile import read_object
from publisher.recipes import Recipe, build_config


class Fp8Bound:
    """FP8 made on a CPU: each dequantized weight against its bf16 source (streamed: as it is quantized, an observer
    of the pass, streaming.TensorObserver; library path: read again afterwards, fp8_dequant_check), within the e4m3
    error bound or the run stops."""

    def __init__(self, label: str) -> None:
        self.label, self.checked, self.worst = label, 0, 0.0

    def begin(self, readable: list[str]) -> list[str] | None:
        return None  # any order

    def wants(self, key: str) -> bool:
        return False  # weights only: they are read whole anyway

    def end(self, ok: bool) -> None:
        pass

    def tensor(self, key: str, value: Any, weight: Any) -> None:
        if type(weight).__name__ != "Float8Tensor":
            return
        rep = check_dequantized(weight, value)
        self.checked += 1
        self.worst = max(self.worst, rep.worst_ratio)
        if not rep.ok:
            raise VerificationError(
                f"{self.label}: {key}: FP8 weight made on the CPU is outside the e4m3 error bound of the base "
                f"(worst ratio {rep.worst_ratio:.3f}, {rep.nonfinite} non-finite values); not publishing it")

    def summary(self) -> dict[str, Any]:
        return {"checked": self.checked, "worst_ratio": self.worst, "unmatched": 0}


def quantize_component(plan: Plan, base_dir: Path, comp: Component, recipe: Recipe, out: Path,
                        device: str, max_shard_size: int | str | None = None) -> tuple[Any, QuantizedComponent]:


    config = build_config(recipe, comp.name)
    # On a GPU the libraries quantize layer by layer as they load (device_map); on a CPU they load
    # then quantize. FP8 recipes on a CPU run torchao's own handler minus its hardware assertion.
    placement: dict[str, Any] = {"device_map": device} if device == "cuda" else {}
    context = cpu_quantization_context(recipe) if device == "cpu" else nullcontext()
    exclude = list(plan.exclude) or None
    src = base_dir / comp.name if comp.name else base_dir
    try:
        model = adapters.of(comp.library).quantized_from_pretrained(comp.class_name, src, config, exclude, placement,
                                                                    context, plan.source.name)
        model.eval()
        dst = out / comp.name if comp.name else out
        shard = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
        model.save_pretrained(dst, safe_serialization=True, **shard)
    except (ValueError, RuntimeError, TypeError, ImportError, AssertionError, NotImplementedError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else f"{type(exc).__name__} with no message"
        raise QuantizeError(f"quantizing {comp.label} ({comp.class_name}) with {recipe.name} failed: {reason}") from exc
    bins = sorted(p.name for p in dst.glob("*.bin"))
    if bins:
        raise QuantizeError(f"{comp.label} was saved as a pickle ({bins[0]}); {recipe.name} cannot be published as safetensors")
    qc = summarize(model, comp, recipe, dst)
    return model, qc


def summarize(model: Any, comp: Component, recipe: Recipe, folder: Path) -> QuantizedComponent:
    """Count what torchao actually did (it skips some shapes silently) and read back the stored config."""
    import torch
    from torchao.utils import TorchAOBaseTensor

    quantized: list[str] = []
    plain: list[str] = []
    classes: dict[str, int] = {}
    layer_classes: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if isinstance(weight, TorchAOBaseTensor):
            quantized.append(name)
            classes[type(weight).__name__] = classes.get(type(weight).__name__, 0) + 1
            layer_classes[name] = type(weight).__name__
        else:
            plain.append(name)
    config = read_object(folder / "config.json")
    qconfig = config.get("quantization_config", {})
    # What the library itself decided to keep (user exclusions plus its defaults such as lm_head),
    # matched with the library's own rule, so "excluded" and "skipped by torchao" are told apart.
    patterns = getattr(getattr(model, "hf_quantizer", None), "modules_to_not_convert", None) or qconfig.get("modules_to_not_convert") or []
    excluded = [n for n in plain if adapters.of(comp.library).kept(f"{n}.weight", patterns)]
    skipped = [n for n in plain if n not in excluded]
    after = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return QuantizedComponent(
        name=comp.name,
        library=comp.library,
        class_name=comp.class_name,
        quantized=quantized,
        skipped=skipped,
        excluded=excluded,
        tensor_classes=classes,
        bytes_before=comp.param_bytes,
        bytes_after=after,
        quantization_config=qconfig,
        layer_classes=layer_classes,
    )


def fp8_dequant_check(model: Any, base_folder: Path, label: str) -> dict[str, Any]:
    """FP8 weights made on a CPU by the library path: every dequantized weight must lie within the e4m3 error
    bound of the bf16 weight it came from (read again from the base safetensors, one tensor at a time)."""
    import torch
    from safetensors import safe_open

    handles = [safe_open(str(p), framework="pt") for p in sorted(base_folder.glob("*.safetensors"))]
    keys = {k: h for h in handles for k in h.keys()}
    bound, missing = Fp8Bound(label), []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or type(module.weight).__name__ != "Float8Tensor":
            continue
        key = f"{name}.weight"
        if key not in keys:
            missing.append(key)
            continue
        bound.tensor(key, keys[key].get_tensor(key).to(torch.bfloat16), module.weight)
    return {**bound.summary(), "unmatched": len(missing)}
