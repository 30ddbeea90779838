"""Stage 3: quantize the planned components with the libraries' own loaders and save a standalone repo folder.

The folder is built under a ".partial" name and renamed only when complete, so an interrupted
run never leaves something that looks finished.
"""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import adapters
from publisher.errors import QuantizeError
from publisher.handoffs.artifacts import Artifacts, QuantizedComponent
from publisher.handoffs.plan import Component, Plan
from publisher.handoffs.report import ForwardInputs
from publisher.io.jsonfile import read_object
from publisher.recipes import Recipe, build_config
from publisher.runtime import progress
from publisher.stages.unfinished import make_partial, remove_partial

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from publisher.stages.fetch import RemoteWeights
    from publisher.stages.lowdisk_push import ShardUploader
    from publisher.stages.unfinished import ComponentCache
    from publisher.verify.inpass import InPassForward

    Observers = Callable[[Component, dict[str, Any]], InPassForward | None]  # another observer of a streamed pass

log = logging.getLogger(__name__)


def quantize_recipe(plan: Plan, base_dir: Path, recipe: Recipe, partial: Path, device: str = "cpu",
                    engine: str = "auto", cache: ComponentCache | None = None, remote: RemoteWeights | None = None,
                    uploader: ShardUploader | None = None, fingerprint: str = "0" * 64,
                    max_shard_size: int | str | None = None, elsewhere: frozenset[str] = frozenset(),
                    inputs: dict[str, ForwardInputs] | None = None, observer: Observers | None = None) -> Artifacts:
    """Quantize every planned component with ``recipe`` and write the standalone repo into ``folder``.

    engine "auto": the streaming engine (one tensor in memory, same bytes as the library path) for every
    component it supports, the library path otherwise; "library" / "streaming" force one.
    ``remote`` (``fetch.RemoteWeights``, --low-disk): the quantized components' weight files were not
    downloaded; the streaming engine reads them by HTTP range, the library path has them fetched first.
    ``uploader`` (``lowdisk_push.ShardUploader``): each finished shard of a streamed component is checked,
    pre-uploaded and deleted at once (no resume cache then: its files leave the disk). ``fingerprint``: the run's
    (publisher.state.state_for), written into the folder's marker (stages/unfinished.py). ``max_shard_size``: the output shard
    size (default: the library's). ``elsewhere``: unchanged base files that go to the target another way (Hub to
    Hub: ``hubcopy``), so they are not copied into the folder. ``inputs``: the run's forward-check inputs
    (verify/capture.py) by component name: a streamed component runs its forward checks during the pass. ``observer``
    (component, its config) -> another observer of a streamed component's pass, or None (the perplexity pass of
    quality/stage.py)."""
    remove_partial(partial)  # an earlier run's unfinished folder; refuses anything that is not ours
    make_partial(partial, fingerprint, recipe.name)
    try:
        _copy_unchanged(plan, base_dir, partial, elsewhere)
        done: list[QuantizedComponent] = []
        models: dict[str, Any] = {}
        for comp in plan.quantized:
            src = base_dir / comp.name if comp.name else base_dir
            dst = partial / comp.name if comp.name else partial
            reused = cache.load(comp.name, dst) if cache is not None else None
            reason = None
            if reused is None:
                reason = (_streaming_reason(comp, src, recipe, device, remote) if engine != "library"
                          else "--engine library")
            if reused is not None:
                # finished by an interrupted run with the same key; verified like a streamed component
                qc = QuantizedComponent(**reused)
                model = None
            elif reason is None:
                log.info("quantizing %s (%s) with %s (streaming engine%s)", comp.label, comp.class_name, recipe.name,
                         ", reading the base by HTTP range" if remote is not None else "")
                qc = _stream_component(plan, src, comp, recipe, partial, device, remote, uploader, max_shard_size, inputs,
                                       observer)
                model = None
            else:
                if engine == "streaming":
                    raise QuantizeError(f"--engine streaming cannot quantize {comp.label}: {reason}; use --engine auto")
                log.info("quantizing %s (%s) with %s (library path: %s)", comp.label, comp.class_name, recipe.name, reason)
                if remote is not None:
                    remote.download(comp)  # the library loaders read local files only
                model, qc = _quantize_component(plan, base_dir, comp, recipe, partial, device, max_shard_size)
                models[comp.name] = model
            _kept_on_purpose(recipe, comp, qc, plan.exclude)
            if device == "cpu" and recipe.cpu_producible and model is not None:
                qc.fp8_check = fp8_dequant_check(model, src, comp.label)  # streamed components were checked tensor by tensor
            if cache is not None and reused is None and uploader is None:
                cache.store(comp.name, dst, {k: v for k, v in asdict(replace(qc, forward=None, eval_forward=None)).items()
                                             if k not in ("forward", "eval_forward")})
            done.append(qc)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise QuantizeError(f"no space left while writing {partial} ({exc.strerror}); free disk space or point --output-dir at a larger disk") from exc
        raise QuantizeError(f"writing the quantized folder {partial} failed: {exc}") from exc
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return Artifacts(recipe=recipe, folder=partial, components=done, models=models, device=device, uploader=uploader)


def _kept_on_purpose(recipe: Recipe, comp: Component, qc: QuantizedComponent, exclude: Sequence[str]) -> None:
    """Whose decision each layer left alone on purpose was: layers a per-layer table maps to None were kept by the user
    ("layer-config"), not skipped by torchao; excluded layers an --exclude pattern names (the library's own rule) too
    ("exclude"); the rest the library kept by its defaults (output heads, tied embeddings)."""
    if recipe.table_for(comp.name) is not None:
        table = recipe.config_for(comp.name).fqn_to_config
        kept = [n for n in qc.skipped if adapters.of(comp.library).resolve(table, f"{n}.weight")[0] is None]
        qc.skipped = [n for n in qc.skipped if n not in kept]
        qc.excluded = sorted(set(qc.excluded) | set(kept))
        qc.kept_by.update(dict.fromkeys(kept, "layer-config"))
    for name in qc.excluded:
        if name not in qc.kept_by and exclude and adapters.of(qc.library).kept(f"{name}.weight", list(exclude)):
            qc.kept_by[name] = "exclude"


def report_layers(artifacts: Artifacts, base_dir: Path, allow_unquantized: bool) -> None:
    """What each component's quantization covered (coverage.py); QuantizeError for a component with no quantized
    layer unless ``allow_unquantized`` (then the card says so)."""
    from publisher.stages.coverage import layer_report, require_quantized

    for c in artifacts.components:
        artifacts.layers[c.name] = layer_report(c.library, c.class_name, base_dir / c.name if c.name else base_dir,
                                                c.quantized, c.skipped, c.excluded, c.kept_by)
        note = require_quantized(c.label, c.class_name, artifacts.recipe.name, artifacts.layers[c.name], allow_unquantized)
        if note:
            artifacts.notes.append(note)


def _streaming_reason(comp: Component, src: Path, recipe: Recipe, device: str, remote: RemoteWeights | None) -> str | None:
    from publisher.streaming import supports

    listing = remote.listing(comp) if remote is not None else ()
    return supports(comp.library, src, recipe, class_name=comp.class_name, device=device, remote_files=listing,
                    component=comp.name)


class _Fp8Bound:
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
        from publisher.errors import VerificationError
        from publisher.fp8cpu import check_dequantized

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


def _stream_component(plan: Plan, src: Path, comp: Component, recipe: Recipe, out: Path, device: str,
                      remote: RemoteWeights | None, uploader: ShardUploader | None,
                      max_shard_size: int | str | None, inputs: dict[str, ForwardInputs] | None = None,
                      extra: Observers | None = None) -> QuantizedComponent:
    from publisher.streaming import StreamJob, stream_quantize
    from publisher.verify.inpass import Together

    dst = out / comp.name if comp.name else out
    fp8 = _Fp8Bound(comp.label) if device == "cpu" and recipe.cpu_producible else None
    sink = uploader.for_component(comp.name, dst) if uploader is not None else None
    verification = _in_pass_forward(src, comp, device, (inputs or {}).get(comp.name))
    evaluation = extra(comp, read_object(src / "config.json")) if extra is not None and device == "cpu" else None
    # the FP8 bound first: a weight outside it stops the pass before the forward passes see it
    observer = Together(fp8, verification, evaluation) if fp8 or verification or evaluation else None
    # Range reads in execution order still fetch each byte once and hash each file in file order: what is read
    # ahead of the hash waits on disk here (integrity.SpillingHashedReader), removed however the pass ends.
    with tempfile.TemporaryDirectory(prefix="hf-ao-publish-spill-") as spill:
        job = StreamJob(src, dst, library=comp.library, recipe=recipe, exclude=list(plan.exclude),  # type: ignore[arg-type]
                        class_name=comp.class_name, component=comp.name, device=device, max_shard_size=max_shard_size,
                        inputs=remote.inputs(comp, Path(spill)) if remote is not None else None,
                        progress=progress.shown(), name_or_path=plan.source.name)
        result = stream_quantize(job, observer=observer, sink=sink)
    if uploader is not None:
        uploader.flush()  # every shard checked, hashed and uploaded before the sizes are counted
    forward = verification.result() if verification is not None else None
    config = read_object(dst / "config.json")
    return QuantizedComponent(
        name=comp.name,
        library=comp.library,
        class_name=comp.class_name,
        quantized=list(result.quantized),
        skipped=list(result.skipped),
        excluded=list(result.excluded),
        tensor_classes=dict(Counter(result.classes.values())),
        bytes_before=comp.param_bytes,
        bytes_after=sum(p.stat().st_size for p in dst.glob("*.safetensors")) + (uploader.uploaded_bytes(dst) if uploader else 0),
        quantization_config=config.get("quantization_config", {}),
        engine="streaming",
        fp8_check=fp8.summary() if fp8 is not None else None,
        peak_rss_bytes=result.peak_rss_bytes,
        stage_seconds={**result.stage_seconds, **({f"ship_{k}": v for k, v in uploader.seconds.items()} if uploader else {})},
        digests=dict(result.digests),
        forward=forward,
        eval_forward=evaluation.result() if evaluation is not None else None,
        layer_classes=dict(result.classes),
    )


def _in_pass_forward(src: Path, comp: Component, device: str, spec: ForwardInputs | None) -> InPassForward | None:
    """The forward passes of verification, run while the engine holds each tensor (verify/inpass.py): on a CPU,
    for components the run derived forward inputs for (``spec``: verify/capture.py, the same call the checks
    after the pass would replay)."""
    from publisher.loadpath import load_call
    from publisher.verify.inpass import InPassForward

    if device != "cpu":
        return None  # the block-by-block forward runs on the CPU; tensors quantized on a GPU stay there
    if spec is None or spec.file is None:
        return None  # weights only (the report says why)
    config = read_object(src / "config.json")
    return InPassForward(comp.library, comp.class_name, config, load_call(spec.file), comp.label)


def _copy_unchanged(plan: Plan, base_dir: Path, out: Path, elsewhere: frozenset[str] = frozenset()) -> None:
    """Everything but the quantized components' weights, the base card (replaced by ours) and ``elsewhere`` (copied
    Hub to Hub), as plain files: a link is read only when it resolves inside the base folder (or the download
    cache's blobs of this repo), and never copied as a link (localfiles)."""
    from publisher.io.localfiles import allowed_roots, copy_regular

    roots = allowed_roots(base_dir)
    skip_prefixes = [f"{c.name}/" if c.name else "" for c in plan.quantized]
    for rel in plan.base_files:
        if rel == "README.md" or rel in elsewhere:
            continue
        in_quantized = any(rel.startswith(p) and "/" not in rel[len(p):] for p in skip_prefixes)
        if in_quantized and (rel.endswith(".safetensors") or rel.endswith(".index.json") or Path(rel).name == "config.json"):
            continue  # rewritten by save_pretrained
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        copy_regular(base_dir / rel, dst, roots)


def _quantize_component(plan: Plan, base_dir: Path, comp: Component, recipe: Recipe, out: Path,
                        device: str, max_shard_size: int | str | None = None) -> tuple[Any, QuantizedComponent]:

    from publisher.fp8cpu import cpu_quantization_context

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
    bound, missing = _Fp8Bound(label), []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or type(module.weight).__name__ != "Float8Tensor":
            continue
        key = f"{name}.weight"
        if key not in keys:
            missing.append(key)
            continue
        bound.tensor(key, keys[key].get_tensor(key).to(torch.bfloat16), module.weight)
    return {**bound.summary(), "unmatched": len(missing)}
