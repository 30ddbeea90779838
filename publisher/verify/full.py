"""Stage 4: prove the saved folder reloads, along every load path, to exactly the in-memory quantized model.

Fixed procedure (as in diffusers' quantizer tests): record inputs, outputs and tensor digests of the
in-memory model -> free it -> reload in fresh interpreters (library path and manual path, in this
environment and any --verify-env) -> compare bit for bit -> measure quality against the bf16 base.
"""

from __future__ import annotations

import gc
import json
import logging
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import adapters, loadpath
from publisher.errors import VerificationError
from publisher.handoffs.artifacts import Artifacts
from publisher.handoffs.report import PATHS, PLAIN_CLASSES, Expected, ForwardInputs, Mode, PathResult, VerifyReport
from publisher.loadpath import save_call
from publisher.streaming.shards import LocalShards
from publisher.verify import streaming as vs
from publisher.verify.closeness import quality_against_base
from publisher.verify.declared import apply_to_expected
from publisher.verify.inputs import token_inputs
from publisher.verify.workers import run_workers

if TYPE_CHECKING:
    from publisher.streaming.shards import ShardSource

log = logging.getLogger(__name__)

GiB = 1024**3
REFERENCE_IN_PASS = "the forward pass on the in-memory quantized tensors during quantization"


def default_inputs(artifacts: Artifacts, work: Path) -> dict[str, ForwardInputs]:
    """Forward inputs when the caller prepared none (verify/capture.py does, from the base pipeline): token ids for
    transformers models, from their signature and config; nothing for diffusers models, which need their pipeline."""

    out: dict[str, ForwardInputs] = {}
    for comp in artifacts.components:
        if not adapters.of(comp.library).token_inputs:
            out[comp.name] = ForwardInputs(None, "", "no pipeline run recorded this component's call")
            continue
        folder = artifacts.folder / comp.name if comp.name else artifacts.folder
        inputs, how = token_inputs(comp.class_name, json.loads((folder / "config.json").read_text()))
        if inputs is None:
            out[comp.name] = ForwardInputs(None, "", how)
            continue
        path = work / f"inputs-{comp.label}.safetensors"
        save_call(inputs, path)
        out[comp.name] = ForwardInputs(path, how)
    return out


def record_expected(artifacts: Artifacts, work: Path, device: str = "cpu",
                    inputs: dict[str, ForwardInputs] | None = None) -> tuple[list[Expected], list[str]]:
    """Inputs, outputs and digests of every in-memory quantized component; then the models are freed."""
    expected: list[Expected] = []
    notes: list[str] = []
    inputs = inputs if inputs is not None else default_inputs(artifacts, work)
    for comp in artifacts.components:
        spec = inputs.get(comp.name)
        inputs_file = spec.file if spec is not None else None
        model = artifacts.models.get(comp.name)
        if model is None:
            # Streamed (or resumed): held one tensor at a time. The engine recorded each tensor's digest
            # while it was in memory, and ran the forward pass on those tensors as it went (verify/inpass.py);
            # without that, the reference output is the block-by-block or library-path reload's (see verify()).
            ran = comp.forward is not None and comp.forward.output is not None and inputs_file is not None
            if ran:
                assert comp.forward is not None
                expected.append(Expected(comp.name, comp.library, comp.class_name, inputs_file, comp.forward.output,
                                         dict(comp.digests), comp.quantized, REFERENCE_IN_PASS,
                                         base_output=comp.forward.base_output))
                continue
            reference = "the in-memory quantized tensors" if comp.digests else "the library-path reload"
            expected.append(Expected(comp.name, comp.library, comp.class_name, inputs_file, None, dict(comp.digests),
                                      comp.quantized, reference, needs_reference=True))
            continue
        output = None
        if inputs_file is not None:
            model.to(device)
            try:
                output = loadpath.forward(model, comp.library, loadpath.load_call(inputs_file, device)).detach().cpu().clone()
            except (RuntimeError, NotImplementedError, AssertionError) as exc:
                if not (device == "cpu" and artifacts.recipe.run.cuda):
                    raise VerificationError(f"the quantized {comp.label} cannot run a forward pass on {device}: {exc}") from exc
                # A GPU recipe verified on a CPU whose torch lacks the kernel (e.g. per-row FP8
                # _scaled_mm before torch 2.13): compare every tensor's bytes, skip the forward.
                notes.append(f"{comp.label}: forward pass not checked on this CPU ({str(exc).splitlines()[0][:160]}); "
                             "tensors compared byte for byte")
                inputs_file = None
        info = loadpath.inspect_model(model)
        expected.append(Expected(comp.name, comp.library, comp.class_name, inputs_file, output, info["digests"], comp.quantized))
    artifacts.release_models()
    gc.collect()
    return expected, notes


def choose_mode(mode: Mode, artifacts: Artifacts, device: str = "cpu") -> tuple[Mode, str | None]:
    """``auto``: a full reload when the largest component fits comfortably in free memory, else streaming."""
    if mode != "auto":
        return mode, None
    if device != "cpu":
        return "full", None  # the block-by-block forward runs on the CPU; GPU recipes reload on their GPU
    import psutil

    largest = max(artifacts.components, key=lambda c: c.bytes_after, default=None)
    if largest is None:
        return "full", None
    need = largest.bytes_after + GiB  # the reloaded component plus an interpreter with torch & co
    available = psutil.virtual_memory().available
    if need <= 0.8 * available:
        return "full", None
    return "streaming", (f"a full reload of {largest.label} needs about {need / GiB:.1f} GiB and "
                         f"{available / GiB:.1f} GiB is free")


def verify(
    artifacts: Artifacts,
    work: Path,
    *,
    envs: Sequence[str | tuple[str, str]] = (),
    base_dir: Path | None = None,
    base_sources: dict[str, ShardSource] | None = None,
    token: str | None = None,
    device: str = "cpu",
    mode: Mode = "auto",
    inputs: dict[str, ForwardInputs] | None = None,
) -> VerifyReport:
    """Run every load path on the saved folder and compare with the in-memory model.

    ``base_sources``: component name -> shard source of its bf16 base (quality); default: ``base_dir``.
    ``inputs``: component name -> the inputs of its forward check (verify/capture.py); default: ``default_inputs``."""

    work.mkdir(parents=True, exist_ok=True)
    mode, why = choose_mode(mode, artifacts, device)
    inputs = inputs if inputs is not None else default_inputs(artifacts, work)
    expected, notes = record_expected(artifacts, work, device, inputs)
    _declared_classes(artifacts, expected)
    report = VerifyReport(
        recipe=artifacts.recipe.name,
        location=str(artifacts.folder),
        passed=False,
        expected_layers={e.component or "model": len(e.quantized) for e in expected},
        tensor_class=artifacts.recipe.tensor_class,
        notes=notes,
        mode=mode,
        forward={c.label: inputs.get(c.name) or ForwardInputs(None, "", "no forward inputs") for c in artifacts.components},
    )
    for e in expected:  # a forward that could not run on this CPU (GPU recipe) is weights only too
        if e.inputs is None and report.forward[e.component or "model"].file is not None:
            report.forward[e.component or "model"] = ForwardInputs(None, "", "its forward pass cannot run on this CPU")
    if base_sources is None and base_dir is not None:
        base_sources = {e.component: LocalShards(base_dir / e.component if e.component else base_dir) for e in expected}
    report.results = []
    if mode == "streaming":
        report.notes.append(
            "Streaming verification" + (f" ({why})" if why else " (--verify-mode streaming)") + ": every tensor was "
            "rebuilt from the saved files and compared with the quantization's in-memory tensor, and one forward "
            "pass ran with one block's weights loaded at a time; no whole-component reload was run.")
        for exp in expected:
            folder = artifacts.folder / exp.component if exp.component else artifacts.folder
            if artifacts.uploaded(exp.component):
                # --low-disk push: checked tensor by tensor before each shard was uploaded and deleted; the forward
                # ran during quantization on those very tensors (or, failing that, runs on the pull request before
                # it is merged: published.check_pull_request)
                ran = exp.output is not None
                report.results.append(PathResult(
                    exp.component, "streaming", "current, before upload", loadpath.versions(), True,
                    f"{artifacts.uploaded(exp.component)} tensors equal before upload; "
                    + ("forward during quantization" if ran else "forward pending on the pull request"),
                    quantized_layers=artifacts.uploaded_layers(exp.component),
                    tensors_checked=artifacts.uploaded(exp.component), forward_checked=ran))
                continue
            report.results.append(vs.streaming_check(exp, LocalShards(folder), artifacts.recipe.tensor_class,
                                                     forward_optional=artifacts.recipe.run.cuda))
    else:
        for exp in expected:
            if not exp.needs_reference:
                continue
            if exp.digests and exp.inputs is not None and device == "cpu":
                # streamed: the reference output is the block-by-block forward of the saved tensors, which the
                # library and manual paths must then reproduce (their tensors are checked against the digests)
                folder = artifacts.folder / exp.component if exp.component else artifacts.folder
                try:
                    _block_reference(exp, LocalShards(folder))
                    continue
                except (OSError, ValueError, KeyError, RuntimeError, TypeError, NotImplementedError, AssertionError) as exc:
                    first = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
                    if artifacts.recipe.run.cuda:  # a GPU format this CPU cannot run (as record_expected): weights only
                        exp.inputs = None
                        report.forward[exp.component or "model"] = ForwardInputs(None, "", "its forward pass cannot run on this CPU")
                        report.notes.append(f"{exp.component or 'model'}: forward pass not checked on this CPU ({first}); "
                                            "tensors compared byte for byte")
                    else:
                        log.warning("block-by-block forward of %s failed (%s); the library-path reload gives the reference",
                                    exp.component or "model", first)
        tensor_class = artifacts.recipe.tensor_class
        report.results += check_location(expected, str(artifacts.folder), None, work, envs=envs, token=token,
                                         tensor_class=tensor_class, device=device,
                                         reference=lambda exp, data: _adopt_reference(exp, data, tensor_class))
        if envs:
            report.notes.append("--verify-env runs the whole-component reloads only (full verification).")
    if base_sources or any(e.base_output is not None for e in expected):
        saved: dict[str, ShardSource] = {e.component: LocalShards(artifacts.folder / e.component if e.component else artifacts.folder)
                 for e in expected if not artifacts.uploaded(e.component)}
        report.quality = quality_against_base(expected, base_sources or {}, saved)
    report.passed = bool(report.results) and not report.failures()
    report.expected = expected
    report.device = device
    return report


def _declared_classes(artifacts: Artifacts, expected: list[Expected]) -> None:
    """Each layer's class, as its config implies it, read the way ``verify TARGET`` reads it (verify/declared.py: the
    saved files against their declared quantization_config); a layer stored otherwise fails here."""

    folders = {e.component: artifacts.folder / e.component if e.component else artifacts.folder for e in expected
               if not artifacts.uploaded(e.component)}
    made = {c.name: c.layer_classes for c in artifacts.components}
    problems = apply_to_expected(expected, folders, made)
    if problems:
        raise VerificationError(f"{artifacts.recipe.name}: the saved files differ from their declared config: {problems[0]}")


def _block_reference(exp: Expected, source: ShardSource) -> None:
    """A streamed component's expected output: one forward with its saved tensors loaded block by block."""

    bf = vs.block_forward(source, exp.library, exp.class_name, vs.load_config(source), loadpath.load_call(exp.inputs))
    exp.output = bf.output
    exp.needs_reference = False
    exp.reference = "the block-by-block forward of the in-memory-equal tensors"


def _adopt_reference(exp: Expected, data: dict[str, Any], tensor_class: str) -> PathResult:
    """A streamed component's library-path reload in this environment: its tensors must equal the in-memory ones the
    streaming engine recorded (when it did), and its output becomes what every other path must match."""
    from safetensors.torch import load_file

    adopted = not exp.digests
    if data.get("ok") and adopted:
        exp.digests = dict(data["digests"])
    result = compare(exp, data, "library", "current", sys.executable, tensor_class)
    if result.ok:
        exp.output = load_file(data["output"])["output"] if data.get("output") else None
        result.forward_checked = False  # its output is the reference, not compared with anything
        result.detail = "reference output for the other paths (streamed: no in-memory model)" + (
            "" if adopted else "; tensors equal to the in-memory quantized tensors")
    return result


# Records a component's expected output (and digests) from its library-path reload here; returns that reload's result.
Reference = Callable[[Expected, dict[str, Any]], PathResult]


def check_location(expected: list[Expected], where: str, revision: str | None, work: Path, *,
                   envs: Sequence[str | tuple[str, str]] = (), token: str | None = None, tensor_class: str | None,
                   paths: tuple[str, ...] = PATHS, device: str = "cpu", reference: Reference | None = None) -> list[PathResult]:
    """Each load path, in each interpreter, on ``where`` (a folder or a Hub repo id), against ``expected``: one fresh
    interpreter per environment and path loads every component in turn (verify/workers.py). ``envs``: interpreter
    paths, or (name, interpreter) pairs (an environment built from a spec). With ``reference``, a component marked
    ``needs_reference`` takes what it must reproduce from its library-path reload in this environment (the first
    path run), which ``reference`` records and reports. Results in the order component, environment, path."""
    import torch

    interpreters = [("current", sys.executable)] + [env if isinstance(env, tuple) else (env, env) for env in envs]
    order = sorted(paths, key=lambda p: p != "library")  # the library path first: it may give the reference
    found: dict[tuple[int, int, int], PathResult] = {}
    for i, (env_name, python) in enumerate(interpreters):
        for path in order:
            log.info("verifying %s via the %s path (%s) on %s", ", ".join(e.component or "model" for e in expected), path,
                     env_name, where)
            datas = run_workers(expected, path, python, where, revision, work, token, torch.get_num_threads(), tag=f"{i}",
                                device=device)
            for k, (exp, data) in enumerate(zip(expected, datas)):
                adopt = reference is not None and exp.needs_reference and i == 0 and path == "library"
                found[k, i, paths.index(path)] = (reference(exp, data) if adopt and reference is not None
                                                  else compare(exp, data, path, env_name, python, tensor_class))
    return [found[key] for key in sorted(found)]


def compare(exp: Expected, data: dict[str, Any], path: str, env_name: str, python: str, tensor_class: str | None) -> PathResult:
    """Bit-for-bit comparison of one reload against the expected record.

    Outcomes (report.Outcome): anything that raised (the load, moving the model, its forward) is a failure the user
    sees; "silently wrong" is only a run that raised nothing and gave wrong classes, tensors or outputs. The class
    each planned layer must have is the one its config implies (``exp.classes``), else ``tensor_class``."""
    import torch
    from safetensors.torch import load_file

    res = PathResult(exp.component, path, env_name, data.get("versions", {}), False)
    classes: dict[str, str] | None = data.get("linear_classes")
    if classes is None:  # the load itself raised
        res.detail = data.get("error", "unknown error")
        res.applicable = not data.get("not_applicable")
        return res
    torchao_like = {c for c in classes.values() if c not in PLAIN_CLASSES}

    def wanted(layer: str) -> str | None:
        return exp.classes.get(layer) or tensor_class

    def right(layer: str) -> bool:
        want = wanted(layer)
        return classes.get(layer) == want if want else classes.get(layer) in torchao_like

    found = Counter(classes.get(n, "missing") for n in exp.quantized)
    res.classes_found = dict(found)
    res.class_found = ", ".join(c for c, _ in found.most_common()) if found else ""
    res.quantized_layers = sum(1 for c in classes.values() if c in torchao_like)
    wrong = [n for n in exp.quantized if not right(n)]
    planned = set(exp.quantized)
    extra = sorted(n for n, c in classes.items() if c in torchao_like and n not in planned)
    layers = ""
    if wrong:
        want = wanted(wrong[0]) or "a torchao tensor"
        layers = (f"{len(exp.quantized) - len(wrong)} of {len(exp.quantized)} planned layers are of the class their "
                  f"config implies (layer {wrong[0]} is {classes.get(wrong[0])}, {want} expected)")
    elif extra:
        layers = f"{len(extra)} layers are quantized that were not planned (layer {extra[0]} is {classes[extra[0]]})"
    if not data.get("ok"):  # it raised after loading: the user sees the error
        error = data.get("error", "unknown error")
        res.detail = f"it loaded, but {layers}; then it raised {error}" if layers else error
        return res
    # From here on nothing raised: anything wrong is "silently wrong"
    res.silent = True
    if wrong or extra:  # an unplanned quantized layer too: without digests (verify TARGET's self-reference) nothing else
        res.detail = f"loads without an error, but {layers}"  # would tell it
        return res
    got = data["digests"]
    res.tensors_checked = len(got)
    for name, digest in exp.digests.items():
        if got.get(name) != digest:
            res.detail = (f"tensor {name} differs from {exp.reference}" if name in got else f"tensor {name} missing after reload")
            return res
    known = set(exp.digests.values())
    unexpected = sorted(n for n in set(got) - set(exp.digests) if got[n] not in known)  # tied weights: saved once
    if unexpected and exp.digests:  # no digests: nothing to compare with (the reference itself did not load)
        res.detail = f"unexpected tensor {unexpected[0]} after reload"
        return res
    bad = data.get("nonfinite")
    if bad:
        res.forward_checked = True
        res.detail = nonfinite_text(bad)
        return res
    if exp.output is not None:
        out = load_file(data["output"])["output"]
        if out.shape != exp.output.shape or out.dtype != exp.output.dtype:
            res.detail = f"output shape/dtype {tuple(out.shape)}/{out.dtype} != {tuple(exp.output.shape)}/{exp.output.dtype}"
            return res
        res.max_abs_diff = float((out.float() - exp.output.float()).abs().max())
        res.forward_checked = True
        if not torch.equal(out, exp.output):
            res.detail = f"output differs from {exp.reference} (max abs diff {res.max_abs_diff:.3g})"
            return res
    res.ok, res.silent = True, False
    return res


def nonfinite_text(bad: dict[str, str]) -> str:
    """How a forward with non-finite outputs is reported (the worker's ``nonfinite`` record)."""
    what = bad.get("what") or "NaN"
    if bad.get("output") == "finite":  # dropped on the way out by a later kernel (see loadpath.run_forward)
        return (f"layer {bad['layer']} computes non-finite values ({what}); the output is finite only because a later "
                "kernel on this machine drops them")
    where = f", first produced by layer {bad['layer']}" if bad.get("layer") else ""
    return f"the output holds non-finite values ({what}){where}"
