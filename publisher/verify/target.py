"""`hf-ao-publish verify TARGET`: check any torchao-quantized diffusers or transformers repo or folder.

Without a reference model, every load path must agree with the others (same tensors, same outputs) and
every quantized layer must be a torchao tensor. When the repo records its base and recipe (our
hf_ao_publish.json) and the base is reachable, the base is re-quantized with the recorded config and
every published tensor must be bit-identical to it: a tampered or corrupted weight fails by name.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from publisher import hub
from publisher import recipes as recipe_registry
from publisher.errors import QuantizeError, SourceError
from publisher.fp8cpu import cpu_quantization_context
from publisher.stages.push import STATE_FILE
from publisher.verify import matrix
from publisher.verify.full import check_location, compare, run_worker
from publisher.verify.inputs import build_inputs, save_inputs
from publisher.verify.report import PATHS, Expected, VerifyReport

log = logging.getLogger(__name__)


@dataclass
class TargetComponent:
    name: str
    library: str
    class_name: str
    config: dict[str, Any]


def _read(target: str, path: str, token: str | None, revision: str | None) -> str | None:
    if Path(target).is_dir():
        p = Path(target) / path
        return p.read_text() if p.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(target, path, revision=revision, token=token)).read_text()
    except EntryNotFoundError:
        return None


def quantized_components(target: str, token: str | None, revision: str | None) -> list[TargetComponent]:
    """Components whose config.json says they were quantized with torchao."""
    index_text = _read(target, "model_index.json", token, revision)
    found: list[TargetComponent] = []
    if index_text:
        for name, value in json.loads(index_text).items():
            if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] not in ("diffusers", "transformers"):
                continue
            cfg_text = _read(target, f"{name}/config.json", token, revision)
            if cfg_text:
                cfg = json.loads(cfg_text)
                if (cfg.get("quantization_config") or {}).get("quant_method") == "torchao":
                    found.append(TargetComponent(name, value[0], value[1], cfg))
    else:
        cfg_text = _read(target, "config.json", token, revision)
        if not cfg_text:
            raise SourceError(f"{target} is neither a diffusers pipeline nor a transformers model (no model_index.json or config.json)")
        cfg = json.loads(cfg_text)
        if (cfg.get("quantization_config") or {}).get("quant_method") == "torchao":
            found.append(TargetComponent("", "transformers", (cfg.get("architectures") or ["AutoModel"])[0], cfg))
    if not found:
        raise SourceError(f"{target} has no torchao-quantized component (no quantization_config with quant_method torchao)")
    return found


def verify_target(target: str, work: Path, *, envs: tuple[str, ...] = (), compat: tuple[str, ...] = (),
                  token: str | None = None, revision: str | None = None, requantize: bool = True) -> VerifyReport:
    """``envs`` (--verify-env) must pass like this environment; ``compat`` (default: the recipe's matrix) is measured."""
    import torch

    matrix.check(envs, compat)
    if not Path(target).is_dir():
        revision = hub.call(hub.client(token).model_info, target, revision=revision, what=f"reading {target}").sha
    comps = quantized_components(target, token, revision)
    state_text = _read(target, STATE_FILE, token, revision)
    state = json.loads(state_text) if state_text else None
    recipe = recipe_registry.get(state["recipe"]) if state and state.get("recipe") in recipe_registry.names() else None
    tensor_class = recipe.tensor_class if recipe else None
    device = recipe_registry.run_device(recipe, recipe_registry.cuda_capability()) if recipe else "cpu"
    report = VerifyReport(recipe=recipe.name if recipe else "unknown", location=target, passed=False,
                          tensor_class=tensor_class or "torchao tensor")
    # built before any load: a spec that cannot be built stops here
    gating = matrix.verify_envs(envs)
    measured = matrix.matrix_envs(compat, recipe.name if recipe else None, {c.library for c in comps},
                                  skip=[e.record.name for e in gating])
    for comp in comps:
        inputs = build_inputs(comp.library, comp.class_name, comp.config)
        inputs_file = save_inputs(inputs, work / f"inputs-{comp.name or 'model'}.safetensors")
        exp = _reference_from_base(comp, state, recipe, work, inputs, inputs_file, token, device) if (requantize and state and recipe) else None
        if exp is None:
            # No reachable base: the library path in this environment is the reference; every other path must agree.
            probe = Expected(comp.name, comp.library, comp.class_name, inputs_file, None, {}, [], "the library path")
            data = run_worker(probe, "library", sys.executable, target, revision, work, token, torch.get_num_threads(), "ref", device)
            if not data.get("ok"):
                report.results.append(compare(probe, data, "library", "current", sys.executable, tensor_class))
                continue
            from safetensors.torch import load_file

            output = load_file(data["output"])["output"] if data.get("output") else None
            quantized = [n for n, c in data["linear_classes"].items() if c not in ("Parameter", "Tensor")]
            exp = Expected(comp.name, comp.library, comp.class_name, inputs_file, output, data["digests"], quantized, "the library path")
        report.expected_layers[comp.name or "model"] = len(exp.quantized)
        report.expected.append(exp)
        report.results += check_location([exp], target, revision, work, envs=[e.pair for e in gating], token=token,
                                         tensor_class=tensor_class, paths=PATHS, device=device)
    report.device = device
    report.passed = bool(report.results) and not report.failures()
    matrix.measure(report, target, revision, work, measured, gating, token=token, device=device)
    return report


def _reference_from_base(comp: TargetComponent, state: dict[str, Any], recipe: Any, work: Path, inputs: Any,
                         inputs_file: Path | None, token: str | None, device: str) -> Expected | None:
    """Re-quantize the recorded base component with the recorded recipe, in memory."""
    from publisher.loadpath import forward, inspect_model, load_component

    base, sha = state.get("base_model"), state.get("base_sha")
    try:
        if base and Path(base).is_dir():
            src: Any = Path(base)
        elif base and sha and not str(sha).startswith("local-"):
            from huggingface_hub import snapshot_download

            pattern = f"{comp.name}/*" if comp.name else "*"
            src = Path(snapshot_download(base, revision=sha, allow_patterns=[pattern, "model_index.json"], token=token))
        else:
            return None
    except (OSError, ValueError) as exc:
        log.warning("base %s@%s is not reachable (%s); comparing load paths with each other only", base, sha, exc)
        return None
    log.info("re-quantizing %s of %s@%s with %s for the reference", comp.name or "model", base, sha, recipe.name)
    config = recipe_registry.build_config(recipe)
    qconf_cls = __import__(comp.library).TorchAoConfig  # diffusers' or transformers' own
    not_convert = (comp.config.get("quantization_config") or {}).get("modules_to_not_convert")
    qdevice = recipe_registry.quantize_device(recipe, recipe_registry.cuda_capability())
    context = cpu_quantization_context(recipe) if qdevice == "cpu" else nullcontext()
    try:
        with context:
            model = load_component(comp.library, comp.class_name, src / comp.name if comp.name else src, device=qdevice,
                                   quantization_config=qconf_cls(config, modules_to_not_convert=not_convert))
    except (AssertionError, RuntimeError, ValueError, ImportError, NotImplementedError) as exc:
        raise QuantizeError(
            f"re-quantizing {comp.name or 'model'} of {base} with {recipe.name} failed ({exc}); "
            "run on hardware that can quantize it, or pass --no-requantize"
        ) from exc
    info = inspect_model(model)
    output = None
    if inputs is not None:
        model.to(device)
        output = forward(model, comp.library, {k: v.to(device) for k, v in inputs.items()}).detach().cpu().clone()
    quantized = [n for n, c in info["linear_classes"].items() if c == recipe.tensor_class]
    del model
    gc.collect()
    return Expected(comp.name, comp.library, comp.class_name, inputs_file, output, info["digests"], quantized,
                     f"the base re-quantized with {recipe.name}")
