"""`hf-ao-publish verify TARGET`: check any torchao-quantized checkpoint, whoever made it (docs/verification.md).

Every layout users have (verify/target_layout.py): a pipeline, a standalone diffusers model folder, a transformers model;
safetensors or a pickle ``.bin`` (read with ``weights_only=True`` only). For each quantized component:

1. what the files hold (verify/stored.py) against what the declared ``quantization_config`` makes of every layer
   (verify/declared.py), and every stored value finite;
2. the base (``--base``, else the ``base_model`` of its hf_ao_publish.json or card, when reachable) re-quantized with
   the declared config, tensor for tensor (verify/against_base.py); without one, the result says plainly that the
   values were only checked for self-consistency;
3. every load path in fresh processes, against the base's re-quantization where the target equals it bit for bit,
   else against the library path here; each layer must come back as the class its config implies, outputs finite.
"""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path
from typing import Any

from publisher import recipe_args
from publisher import recipes as recipe_registry
from publisher.errors import UsageError
from publisher.errors import UsageError as NotDescribable
from publisher.handoffs.report import PATHS, PLAIN_CLASSES, ContentCheck, Expected, ForwardInputs, PathResult, VerifyReport
from publisher.handoffs.statefile import STATE_FILE
from publisher.io.localfiles import named_folder
from publisher.loadpath import forward, inspect_model, load_call, load_component
from publisher.verify import against_base, capture, declared, matrix, stored, target_layout
from publisher.verify import hashes as hashes_check
from publisher.verify.full import check_location, compare
from publisher.verify.target_layout import TargetComponent

log = logging.getLogger(__name__)

SELF_ONLY = ("the load paths against each other and the files against the formats their declared config makes, "
             "nothing against the base; pass --base BASE to compare them")


def verify_target(target: str, work: Path, *, envs: tuple[str, ...] = (), compat: tuple[str, ...] = (),
                  token: str | None = None, revision: str | None = None, requantize: bool = True,
                  base: str | None = None) -> VerifyReport:
    """``envs`` (--verify-env) must pass like this environment; ``compat`` (default: the recipe's matrix) is measured;
    ``base`` (--base): the unquantized model to compare with (default: the one the target names, when reachable)."""
    matrix.check(envs, compat)
    if base and not requantize:
        raise UsageError("--base and --no-requantize contradict each other; give one")
    named_folder(target, "TARGET")  # a mistyped folder is said to be one, not taken for a repo id
    where, where_rev = target, revision  # where the load paths read: a Hub target's checked local copy
    if not Path(target).is_dir():
        local, sha, hashes = hashes_check.fetch_target_configs(target, revision, token, STATE_FILE)
        where, where_rev, revision = str(local), None, sha  # every later read sees the checked commit
    folder = Path(where)
    comps = target_layout.components(folder, target)
    if not Path(target).is_dir():
        hashes_check.fetch_target_components(target, sha, hashes, [c.name for c in comps], token)
    state = target_layout.read_json(folder, STATE_FILE)
    report = VerifyReport(recipe=str(state.get("recipe")) if state and state.get("recipe") else "unknown", location=target,
                          passed=False)
    checks = {}
    for comp in comps:
        decl, check, rows = check_files(comp, folder, target)
        checks[comp.name] = (decl, check)
        report.content += rows
    recipe = declared_recipe(report.recipe, checks)
    device = recipe_registry.device(recipe, recipe_registry.cuda_capability()) if recipe else "cpu"
    implied = {c for _, check in checks.values() for c in check.classes.values()}
    if len(implied) == 1:  # one class for every layer: the report's class, as a recipe's would be
        report.tensor_class = implied.pop()
    elif recipe is not None:
        report.tensor_class = recipe.tensor_class
    chosen, why = against_base.find(base, *target_layout.declared_base(folder, state), state, token) if requantize else (
        None, "--no-requantize")
    report.forward = _forward_inputs(target, comps, work, token, revision)
    # built before any load: a spec that cannot be built stops here
    gating = matrix.verify_envs(envs)
    classes = sorted(implied | set(recipe.tensor_classes if recipe else ()))
    measured = matrix.matrix_envs(compat, classes or None, {c.library for c in comps},
                                  skip=[e.record.name for e in gating])
    for comp in comps:
        decl, check = checks[comp.name]
        inputs_file = report.forward[comp.label].file
        exp = None
        if chosen is not None and decl is not None:
            exp = _against(comp, decl, check, chosen, state, folder, inputs_file, device, target, token, report, recipe)
        if exp is None:  # no base to compare with: its library path here is the reference (check_location's)
            exp = Expected(comp.name, comp.library, comp.class_name, inputs_file, None, {}, sorted(check.classes),
                           "the library path", classes=dict(check.classes), dtype=check.dtype, needs_reference=True)
        report.expected.append(exp)
    tensor_class = report.tensor_class or None
    report.results += check_location(report.expected, where, where_rev, work, envs=[e.pair for e in gating], token=token,
                                     tensor_class=tensor_class, paths=PATHS, device=device,
                                     reference=lambda exp, data: _self_reference(exp, data, tensor_class))
    for comp, exp in zip(comps, report.expected):
        report.expected_layers[comp.label] = len(exp.quantized)
    compared = [c for c in report.content if c.what == "against the base" and c.checked]
    if chosen is not None and len(compared) < len(comps):
        why = f"the base {chosen.display} could not be compared with {len(comps) - len(compared)} of {len(comps)} components"
    report.base = chosen.display if chosen and compared else None
    report.self_consistency_only = len(compared) < len(comps)  # some component's values were compared with nothing
    report.values = (f"compared with the base {chosen.display} (named by {chosen.origin}) re-quantized with the "
                     "declared config" if chosen and len(compared) == len(comps) else
                     f"only checked for self-consistency ({why}): {SELF_ONLY}")
    if report.self_consistency_only:
        log.warning("%s: values %s", target, report.values)
    report.device = device
    report.passed = bool(report.results) and not report.failures() and not report.content_failures()
    matrix.measure(report, target, revision, work, measured, gating, token=token, device=device)
    return report


def declared_recipe(name: str, checks: dict[str, tuple[declared.Declared | None, declared.DeclaredCheck]]
                    ) -> recipe_registry.Recipe | None:
    """The target's declared configs as a recipe (its hardware follows the configs, whoever made them); None when a
    component's config cannot be rebuilt or described here."""

    configs = {comp: d.config for comp, (d, _) in checks.items() if d is not None}
    if len(configs) != len(checks):
        return None
    try:
        recipe = recipe_args.from_configs(name, configs)
        recipe.facts  # noqa: B018 - probed now: a config this machine cannot describe leaves the defaults
    except NotDescribable as exc:
        log.info("the declared configs' hardware needs are not known here (%s); verifying on the CPU", exc)
        return None
    return recipe


def check_files(comp: TargetComponent, folder: Path, target: str
                ) -> tuple[declared.Declared | None, declared.DeclaredCheck, list[ContentCheck]]:
    """What one component's files in ``folder`` (the target's local copy) hold: the declared config against the stored
    tensors, and the stored values. Returns the rebuilt config (None: unreadable), the layer check and the rows."""
    where = f"{target}/{comp.name + '/' if comp.name else ''}config.json"
    files = folder / comp.name if comp.name else folder
    found = stored.describe_files(files, target_layout.weight_format(files))  # read once: a pickle is loaded whole
    decl, result = declared.check_saved(comp, found, where)
    if decl is None:
        return None, declared.DeclaredCheck(comp.name, "unreadable"), [ContentCheck(comp.name, "declared config", False,
                                                                                     result.problems[0])]
    detail = (result.problems[0] if result.problems else
              f"{result.checked} quantized layers stored as the declared {decl.text} makes them")
    rows = [ContentCheck(comp.name, "declared config", not result.problems, detail, result.notes, result.checked)]
    problems, value_notes = stored.scan_values(files, found)
    rows.append(ContentCheck(comp.name, "stored values", not problems, problems[0] if problems else
                             "every stored value is finite", value_notes, len(found.tensors)))
    return decl, result, rows


def _strict(state: dict[str, Any] | None, chosen: against_base.Base, qdevice: str) -> str | None:
    """Why the target must equal the base's re-quantization bit for bit (None: it was not made as here)."""
    import importlib.metadata as md

    if not state or not chosen.named_by(state.get("base_model")) or not state.get("recipe") or state.get("tool") != "hf-ao-publish":
        return None
    made = state.get("versions") or {}
    here = {n: md.version(n) for n in ("torch", "torchao")}
    if any(made.get(n) != v for n, v in here.items()):
        return None
    if qdevice != "cpu":
        return None  # a GPU quantizes with kernels whose rounding this check does not claim to reproduce
    return (f"its hf_ao_publish.json records {state['recipe']} made with torch {here['torch']} and torchao "
            f"{here['torchao']}, which quantize deterministically on a CPU, as here")


def base_row(comp: TargetComponent, decl: declared.Declared, check: declared.DeclaredCheck, chosen: against_base.Base,
             state: dict[str, Any] | None, folder: Path, target: str, token: str | None,
             recipe: recipe_registry.Recipe | None = None) -> tuple[ContentCheck, Any, str]:
    """The target's component against its base re-quantized with the declared config: the content row, the
    re-quantized model when the target equals it bit for bit (else None), and how it was made."""

    src = against_base.component_folder(chosen, comp, target, token)
    # where the target's configs are made (a GPU-only format on its GPU); anything else, as diffusers does, on the CPU
    qdevice = recipe_registry.device(recipe, recipe_registry.cuda_capability()) if recipe else "cpu"
    strict = _strict(state, chosen, qdevice)
    ours = f"{state['recipe']} (its declared {decl.text})" if strict and state else f"the declared {decl.text}"
    what = f"the base re-quantized with {ours}"
    reference = against_base.requantize(comp, decl, src, check.dtype, qdevice, chosen)
    files = folder / comp.name if comp.name else folder
    try:
        loaded = load_component(comp.library, comp.class_name, files, device=qdevice, dtype=check.dtype)
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
        return ContentCheck(comp.name, "against the base", True, "not compared: the target does not load with the "
                            f"library path here ({type(exc).__name__}); see its load paths"), None, what
    row, identical = against_base.compare(comp, reference, loaded, src, strict, what)
    del loaded
    gc.collect()
    return row, reference if identical else None, what


def _against(comp: TargetComponent, decl: declared.Declared, check: declared.DeclaredCheck, chosen: against_base.Base,
             state: dict[str, Any] | None, folder: Path, inputs_file: Path | None, device: str, target: str,
             token: str | None, report: VerifyReport, recipe: recipe_registry.Recipe | None = None) -> Expected | None:
    """Compare the target with its base re-quantized; the expected record for the load paths when they are
    bit-identical (else None: the load paths are compared with each other, and the content row decides)."""

    row, reference, what = base_row(comp, decl, check, chosen, state, folder, target, token, recipe)
    report.content.append(row)
    if reference is None:
        gc.collect()
        return None
    # recorded as every load path records it, after moving the model (torchao's IntxUnpackedToInt8Tensor.to() casts
    # a bfloat16 scale to the tensor's dtype, so a float32 checkpoint's digests change with the move)
    reference.to(device)
    info = inspect_model(reference)
    output = None
    if inputs_file is not None:
        output = forward(reference, comp.library, load_call(inputs_file, device)).detach().cpu().clone()
    quantized = sorted({n for n, c in info["linear_classes"].items() if c not in PLAIN_CLASSES} | set(check.classes))
    del reference
    gc.collect()
    return Expected(comp.name, comp.library, comp.class_name, inputs_file, output, info["digests"], quantized, what,
                    classes=dict(check.classes), dtype=check.dtype)


def _self_reference(exp: Expected, data: dict[str, Any], tensor_class: str | None) -> PathResult:
    """No base to compare with: the library path's reload in a fresh process (``data``) is the reference every other
    path must match; recorded as the library path's own result, so it is not run twice."""
    from safetensors.torch import load_file

    if data.get("ok"):
        loaded = {n for n, c in data["linear_classes"].items() if c not in PLAIN_CLASSES}
        exp.quantized = sorted(loaded | set(exp.quantized))
        exp.digests = dict(data["digests"])
        exp.output = load_file(data["output"])["output"] if data.get("output") else None
    result = compare(exp, data, "library", "current", sys.executable, tensor_class)
    if result.ok:
        result.forward_checked = False  # its output is the reference, not compared with anything
        result.detail = "the reference for the other paths (no base to compare with)"
    return result


def _forward_inputs(target: str, comps: list[TargetComponent], work: Path, token: str | None,
                    revision: str | None) -> dict[str, ForwardInputs]:
    """The inputs of each component's forward check, derived from the target itself (its pipeline's own call, or
    token ids): a Hub target is fetched without the quantized components' weights, which the pipeline run never
    reads (the denoiser is built on the meta device)."""
    folder = Path(target)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        skip = [f"{c.name}/*.{ext}" if c.name else f"*.{ext}" for c in comps for ext in ("safetensors", "bin")]
        folder = Path(snapshot_download(target, revision=revision, token=token, ignore_patterns=skip))
    index = target_layout.read_json(folder, "model_index.json")
    pipeline_class = index.get("_class_name") if index else None
    found = capture.for_components(folder, pipeline_class if isinstance(pipeline_class, str) else None,
                                   {c.name: (c.library, c.class_name) for c in comps}, work / "inputs")
    return {c.label: found.get(c.name) or ForwardInputs(None, "", "no forward inputs") for c in comps}
