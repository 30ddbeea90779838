"""`hf-ao-publish verify TARGET`: check any torchao-quantized diffusers or transformers repo or folder.

Without a reference model, every load path must agree with the others (same tensors, same outputs) and
every quantized layer must be a torchao tensor. When the repo records its base and recipe (our
hf_ao_publish.json) and the base is reachable, the base is re-quantized with the recorded config and
every published tensor must be bit-identical to it: a tampered or corrupted weight fails by name.
"""

from __future__ import annotations

import gc
import logging
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from publisher import recipes as recipe_registry
from publisher.errors import QuantizeError, SourceError
from publisher.fp8cpu import cpu_quantization_context
from publisher.jsonfile import read_object
from publisher.loadpath import load_call
from publisher.localfiles import allowed_roots, plain_name
from publisher.stages.push import STATE_FILE
from publisher.verify import capture, matrix
from publisher.verify import hashes as hashes_check
from publisher.verify.full import check_location, compare, run_worker
from publisher.verify.report import PATHS, Expected, ForwardInputs, VerifyReport

log = logging.getLogger(__name__)


@dataclass
class TargetComponent:
    name: str
    library: str
    class_name: str
    config: dict[str, Any]


def _read(target: str, path: str, token: str | None, revision: str | None) -> dict[str, Any] | None:
    """A JSON file of the target, through the one JSON reader (size limit, UTF-8, an object); None if absent."""
    if Path(target).is_dir():
        p = Path(target) / path
        return read_object(p, roots=allowed_roots(Path(target))) if p.is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        local = hf_hub_download(target, path, revision=revision, token=token)
    except EntryNotFoundError:
        return None
    return read_object(Path(local), f"{target}/{path}")


def quantized_components(target: str, token: str | None, revision: str | None) -> list[TargetComponent]:
    """Components whose config.json says they were quantized with torchao."""
    index = _read(target, "model_index.json", token, revision)
    found: list[TargetComponent] = []
    if index:
        for name, value in index.items():
            if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] not in ("diffusers", "transformers"):
                continue
            if not plain_name(name) or not isinstance(value[1], str):
                raise SourceError(f"{target}/model_index.json names a component {name!r} ({value!r}) that is not a "
                                  "plain folder name and class; refusing to read it")
            cfg = _read(target, f"{name}/config.json", token, revision)
            if cfg:
                if (cfg.get("quantization_config") or {}).get("quant_method") == "torchao":
                    found.append(TargetComponent(name, value[0], value[1], cfg))
    else:
        cfg = _read(target, "config.json", token, revision)
        if not cfg:
            raise SourceError(f"{target} is neither a diffusers pipeline nor a transformers model (no model_index.json or config.json)")
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
    where, where_rev = target, revision  # where the load paths read: a Hub target's checked local copy
    if not Path(target).is_dir():
        local, sha, hashes = hashes_check.fetch_target_configs(target, revision, token, STATE_FILE)
        where, where_rev, revision = str(local), None, sha  # every later read sees the checked commit
    comps = quantized_components(where, token, where_rev)
    if not Path(target).is_dir():
        hashes_check.fetch_target_components(target, sha, hashes, [c.name for c in comps], token)
    state = _read(where, STATE_FILE, token, where_rev)
    recipe = recipe_registry.get(state["recipe"]) if state and state.get("recipe") in recipe_registry.names() else None
    tensor_class = recipe.tensor_class if recipe else None
    device = recipe_registry.run_device(recipe, recipe_registry.cuda_capability()) if recipe else "cpu"
    report = VerifyReport(recipe=recipe.name if recipe else "unknown", location=target, passed=False,
                          tensor_class=tensor_class or "torchao tensor")
    report.forward = _forward_inputs(target, comps, work, token, revision)
    # built before any load: a spec that cannot be built stops here
    gating = matrix.verify_envs(envs)
    measured = matrix.matrix_envs(compat, recipe.name if recipe else None, {c.library for c in comps},
                                  skip=[e.record.name for e in gating])
    for comp in comps:
        inputs_file = report.forward[comp.name or "model"].file
        inputs = load_call(inputs_file) if inputs_file else None
        exp = (_reference_from_base(comp, state, recipe, work, inputs, inputs_file, token, device, target)
               if (requantize and state and recipe) else None)
        if exp is None:
            # No reachable base: the library path in this environment is the reference; every other path must agree.
            probe = Expected(comp.name, comp.library, comp.class_name, inputs_file, None, {}, [], "the library path")
            data = run_worker(probe, "library", sys.executable, where, where_rev, work, token, torch.get_num_threads(), "ref", device)
            if not data.get("ok"):
                report.results.append(compare(probe, data, "library", "current", sys.executable, tensor_class))
                continue
            from safetensors.torch import load_file

            output = load_file(data["output"])["output"] if data.get("output") else None
            quantized = [n for n, c in data["linear_classes"].items() if c not in ("Parameter", "Tensor")]
            exp = Expected(comp.name, comp.library, comp.class_name, inputs_file, output, data["digests"], quantized, "the library path")
        report.expected_layers[comp.name or "model"] = len(exp.quantized)
        report.expected.append(exp)
        report.results += check_location([exp], where, where_rev, work, envs=[e.pair for e in gating], token=token,
                                         tensor_class=tensor_class, paths=PATHS, device=device)
    report.device = device
    report.passed = bool(report.results) and not report.failures()
    matrix.measure(report, target, revision, work, measured, gating, token=token, device=device)
    return report


def _forward_inputs(target: str, comps: list[TargetComponent], work: Path, token: str | None,
                    revision: str | None) -> dict[str, ForwardInputs]:
    """The inputs of each component's forward check, derived from the target itself (its pipeline's own call, or
    token ids): a Hub target is fetched without the quantized components' weights, which the pipeline run never
    reads (the denoiser is built on the meta device)."""
    folder = Path(target)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        skip = [f"{c.name}/*.safetensors" if c.name else "*.safetensors" for c in comps]
        folder = Path(snapshot_download(target, revision=revision, token=token, ignore_patterns=skip))
    index_text = _read(str(folder), "model_index.json", token, revision)
    pipeline_class = index_text.get("_class_name") if index_text else None
    found = capture.for_components(folder, pipeline_class if isinstance(pipeline_class, str) else None,
                                   {c.name: (c.library, c.class_name) for c in comps}, work / "inputs")
    return {c.name or "model": found.get(c.name) or ForwardInputs(None, "", "no forward inputs") for c in comps}


def _reference_from_base(comp: TargetComponent, state: dict[str, Any], recipe: Any, work: Path, inputs: Any,
                         inputs_file: Path | None, token: str | None, device: str, target: str) -> Expected | None:
    """Re-quantize the recorded base component with the recorded recipe, in memory; a Hub base's files are checked
    against the hashes the target recorded and the Hub's before they are read."""
    from publisher.loadpath import forward, inspect_model, load_component

    base, sha = state.get("base_model"), state.get("base_sha")
    try:
        if base and Path(base).is_dir():
            src: Any = Path(base)
        elif base and sha and not str(sha).startswith("local-"):
            src = hashes_check.fetch_base_component(base, sha, comp.name, state.get("base_files"), target, token)
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
        output = forward(model, comp.library, load_call(inputs_file, device)).detach().cpu().clone()
    quantized = [n for n, c in info["linear_classes"].items() if c == recipe.tensor_class]
    del model
    gc.collect()
    return Expected(comp.name, comp.library, comp.class_name, inputs_file, output, info["digests"], quantized,
                     f"the base re-quantized with {recipe.name}")
