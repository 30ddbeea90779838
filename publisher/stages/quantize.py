"""Stage 3: quantize the planned components with the libraries' own loaders and save a standalone repo folder.

The folder is built under a ".partial" name and renamed only when complete, so an interrupted
run never leaves something that looks finished.
"""

from __future__ import annotations

import errno
import logging
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import adapters
from publisher.errors import PublishError, QuantizeError
from publisher.handoffs.artifacts import Artifacts, QuantizedComponent
from publisher.handoffs.plan import Component, Plan
from publisher.handoffs.report import ForwardInputs
from publisher.io.jsonfile import read_object
from publisher.io.localfiles import allowed_roots, copy_regular
from publisher.loadpath import load_call
from publisher.recipes import Recipe
from publisher.runtime import progress
from publisher.stages.coverage import layer_report, require_quantized
from publisher.stages.library_quantize import Fp8Bound, fp8_dequant_check, quantize_component
from publisher.stages.unfinished import make_partial, remove_partial
from publisher.streaming import StreamJob, StreamResult, stream_quantize_many, supports
from publisher.verify.inpass import InPassForward, Together

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from publisher.stages.fetch import RemoteWeights
    from publisher.stages.library_quantize import Fp8Bound
    from publisher.stages.lowdisk_push import ShardUploader
    from publisher.stages.unfinished import ComponentCache
    from publisher.streaming import StreamResult, TensorObserver
    from publisher.verify.inpass import InPassForward

    Observers = Callable[[Component, dict[str, Any]], InPassForward | None]  # another observer of a streamed pass

log = logging.getLogger(__name__)


@dataclass
class RecipeTarget:
    """One recipe of the quantize stage: its unfinished folder, device, resume cache and shard uploader."""

    recipe: Recipe
    partial: Path
    device: str = "cpu"
    cache: ComponentCache | None = None
    uploader: ShardUploader | None = None  # --low-disk with a push: its shards checked, pre-uploaded and deleted
    fingerprint: str = "0" * 64
    done: list[QuantizedComponent] = field(default_factory=list)
    models: dict[str, Any] = field(default_factory=dict)
    error: PublishError | None = None

    def dst(self, comp: Component) -> Path:
        return self.partial / comp.name if comp.name else self.partial


def quantize_recipe(plan: Plan, base_dir: Path, recipe: Recipe, partial: Path, device: str = "cpu",
                    engine: str = "auto", cache: ComponentCache | None = None, remote: RemoteWeights | None = None,
                    uploader: ShardUploader | None = None, fingerprint: str = "0" * 64,
                    max_shard_size: int | str | None = None, elsewhere: frozenset[str] = frozenset(),
                    inputs: dict[str, ForwardInputs] | None = None, observer: Observers | None = None) -> Artifacts:
    """Quantize every planned component with ``recipe`` and write the standalone repo into ``partial``
    (``quantize_recipes`` with one recipe; its error raised)."""
    target = RecipeTarget(recipe, partial, device, cache, uploader, fingerprint)
    (got,) = quantize_recipes(plan, base_dir, [target], engine=engine, remote=remote, max_shard_size=max_shard_size,
                              elsewhere=elsewhere, inputs=inputs, observer=observer)
    if not isinstance(got, Artifacts):
        raise got
    return got


def quantize_recipes(plan: Plan, base_dir: Path, targets: Sequence[RecipeTarget], *, engine: str = "auto",
                     remote: RemoteWeights | None = None, max_shard_size: int | str | None = None,
                     elsewhere: frozenset[str] = frozenset(), inputs: dict[str, ForwardInputs] | None = None,
                     observer: Observers | None = None) -> list[Artifacts | PublishError]:
    """Quantize every planned component with each target's recipe and write each standalone repo into its folder.

    The components the streaming engine takes are read once for all the recipes (one pass, each tensor handed to
    every recipe: ``streaming.stream_quantize_many``; one pass per device when the recipes quantize on several).
    A recipe that fails (PublishError, or an OSError writing its folder) is dropped, its folder removed, its error
    returned in its place; the others go on. engine "auto": the streaming engine (one tensor in memory, same bytes as
    the library path) for every component it supports, the library path otherwise; "library" / "streaming" force
    one. ``remote`` (``fetch.RemoteWeights``, --low-disk): the quantized components' weight files were not
    downloaded; the streaming engine reads them by HTTP range, the library path has them fetched first. A target's
    ``uploader`` (``lowdisk_push.ShardUploader``): each finished shard of a streamed component is checked,
    pre-uploaded and deleted at once (no resume cache then: its files leave the disk). Its ``fingerprint``: the
    run's (publisher.state.state_for), written into the folder's marker (stages/unfinished.py). ``max_shard_size``:
    the output shard size (default: the library's). ``elsewhere``: unchanged base files that go to the target another
    way (Hub to Hub: ``hubcopy``), so they are not copied into the folder. ``inputs``: the run's forward-check inputs
    (verify/capture.py) by component name: a streamed component runs its forward checks during the pass.
    ``observer`` (component, its config) -> another observer of a streamed component's pass, or None (the
    perplexity pass of quality/stage.py)."""
    live: list[RecipeTarget] = []
    try:
        for t in targets:
            with _failing(t, live, remove=False):
                remove_partial(t.partial)  # an earlier run's unfinished folder; refuses anything that is not ours
            if t.error is None:
                with _failing(t, live):
                    make_partial(t.partial, t.fingerprint, t.recipe.name)
                    _copy_unchanged(plan, base_dir, t.partial, elsewhere)
                    live.append(t)
        for comp in plan.quantized:
            src = base_dir / comp.name if comp.name else base_dir
            streamed: dict[str, list[RecipeTarget]] = {}
            for t in list(live):
                with _failing(t, live):
                    if not _reused_or_library(plan, base_dir, comp, src, t, engine, remote, max_shard_size):
                        streamed.setdefault(t.device, []).append(t)
            for group in streamed.values():
                for t, got in zip(group, _stream_component(plan, src, comp, group, remote, max_shard_size, inputs,
                                                           observer)):
                    with _failing(t, live):
                        if not isinstance(got, QuantizedComponent):
                            raise got
                        _kept_on_purpose(t.recipe, comp, got, plan.exclude)
                        _store(t, comp, got)
                        t.done.append(got)
    except BaseException:
        for t in live:
            shutil.rmtree(t.partial, ignore_errors=True)
        raise
    return [t.error if t.error is not None else
            Artifacts(recipe=t.recipe, folder=t.partial, components=t.done, models=t.models, device=t.device,
                      uploader=t.uploader) for t in targets]


def one_pass(plan: Plan, base_dir: Path, targets: Sequence[RecipeTarget], engine: str,
             remote: RemoteWeights | None) -> bool:
    """Whether several recipes share one pass: the streaming engine takes every component for each of them (the
    library path holds each recipe's model in memory until it is verified: those go one at a time)."""
    if len(targets) < 2 or engine == "library":
        return False
    return all(_streaming_reason(comp, base_dir / comp.name if comp.name else base_dir, t.recipe, t.device, remote) is None
               for comp in plan.quantized for t in targets)


@contextmanager
def _failing(target: RecipeTarget, live: list[RecipeTarget], remove: bool = True) -> Iterator[None]:
    """A step of one recipe: its failure (PublishError; OSError, said as a QuantizeError) drops that recipe, removes
    its unfinished folder (``remove``: it is ours) and is kept as its result; the other recipes go on."""
    try:
        yield
    except (PublishError, OSError) as exc:
        if target in live:
            live.remove(target)
        if remove:
            shutil.rmtree(target.partial, ignore_errors=True)
        target.error = exc if isinstance(exc, PublishError) else _write_error(target.partial, exc)


def _write_error(partial: Path, exc: OSError) -> QuantizeError:
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return QuantizeError(f"no space left while writing {partial} ({exc.strerror}); free disk space or point --output-dir at a larger disk")
    return QuantizeError(f"writing the quantized folder {partial} failed: {exc}")


def _reused_or_library(plan: Plan, base_dir: Path, comp: Component, src: Path, t: RecipeTarget, engine: str,
                       remote: RemoteWeights | None, max_shard_size: int | str | None) -> bool:
    """``comp`` for one recipe from its resume cache, or by the library path; False: the streaming engine takes it."""

    recipe, device, dst = t.recipe, t.device, t.dst(comp)
    reused = t.cache.load(comp.name, dst) if t.cache is not None else None
    if reused is not None:
        # finished by an interrupted run with the same key; verified like a streamed component
        qc = QuantizedComponent(**reused)
    else:
        reason = _streaming_reason(comp, src, recipe, device, remote) if engine != "library" else "--engine library"
        if reason is None:
            log.info("quantizing %s (%s) with %s (streaming engine%s)", comp.label, comp.class_name, recipe.name,
                     ", reading the base by HTTP range" if remote is not None else "")
            return False
        if engine == "streaming":
            raise QuantizeError(f"--engine streaming cannot quantize {comp.label}: {reason}; use --engine auto")
        log.info("quantizing %s (%s) with %s (library path: %s)", comp.label, comp.class_name, recipe.name, reason)
        if remote is not None:
            remote.download(comp)  # the library loaders read local files only
        model, qc = quantize_component(plan, base_dir, comp, recipe, t.partial, device, max_shard_size)
        t.models[comp.name] = model
        if device == "cpu" and recipe.cpu_producible:
            qc.fp8_check = fp8_dequant_check(model, src, comp.label)  # streamed components are checked tensor by tensor
    _kept_on_purpose(recipe, comp, qc, plan.exclude)
    if reused is None:
        _store(t, comp, qc)
    t.done.append(qc)
    return True


def _store(t: RecipeTarget, comp: Component, qc: QuantizedComponent) -> None:
    """Into the recipe's resume cache, unless its shards leave the disk (a staged push)."""
    if t.cache is not None and t.uploader is None:
        t.cache.store(comp.name, t.dst(comp), {k: v for k, v in asdict(replace(qc, forward=None, eval_forward=None)).items()
                                               if k not in ("forward", "eval_forward")})


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

    for c in artifacts.components:
        artifacts.layers[c.name] = layer_report(c.library, c.class_name, base_dir / c.name if c.name else base_dir,
                                                c.quantized, c.skipped, c.excluded, c.kept_by)
        note = require_quantized(c.label, c.class_name, artifacts.recipe.name, artifacts.layers[c.name], allow_unquantized)
        if note:
            artifacts.notes.append(note)


def _streaming_reason(comp: Component, src: Path, recipe: Recipe, device: str, remote: RemoteWeights | None) -> str | None:
    listing = remote.listing(comp) if remote is not None else ()
    return supports(comp.library, src, recipe, class_name=comp.class_name, device=device, remote_files=listing,
                    component=comp.name)


def _stream_component(plan: Plan, src: Path, comp: Component, group: Sequence[RecipeTarget],
                      remote: RemoteWeights | None, max_shard_size: int | str | None,
                      inputs: dict[str, ForwardInputs] | None = None,
                      extra: Observers | None = None) -> list[QuantizedComponent | PublishError]:
    """One read of ``comp`` for every recipe of ``group`` (one device): each its own observers (FP8 bound, forward
    checks, perplexity) and sink; a QuantizedComponent, or the recipe's error, per target."""

    # several recipes: one quantize call or quantized block forward at a time (memory: verify/inpass.py)
    gate = threading.RLock() if len(group) > 1 else None
    bounds: list[Fp8Bound | None] = []
    forwards: list[InPassForward | None] = []
    evaluations: list[InPassForward | None] = []
    observers: list[TensorObserver | None] = []
    for t in group:
        bounds.append(Fp8Bound(comp.label) if t.device == "cpu" and t.recipe.cpu_producible else None)
        forwards.append(_in_pass_forward(src, comp, t.device, (inputs or {}).get(comp.name), gate))
        evaluations.append(extra(comp, read_object(src / "config.json")) if extra is not None and t.device == "cpu" else None)
        # the FP8 bound first: a weight outside it stops the pass before the forward passes see it
        parts = (bounds[-1], forwards[-1], evaluations[-1])
        observers.append(Together(*parts) if any(parts) else None)
    sinks = [t.uploader.for_component(comp.name, t.dst(comp)) if t.uploader is not None else None for t in group]
    # Range reads in execution order still fetch each byte once and hash each file in file order: what is read
    # ahead of the hash waits on disk here (integrity.SpillingHashedReader), removed however the pass ends.
    with tempfile.TemporaryDirectory(prefix="hf-ao-publish-spill-") as spill:
        shards = remote.inputs(comp, Path(spill)) if remote is not None else None
        jobs = [StreamJob(src, t.dst(comp), library=comp.library, recipe=t.recipe, exclude=list(plan.exclude),  # type: ignore[arg-type]
                          class_name=comp.class_name, component=comp.name, device=t.device,
                          max_shard_size=max_shard_size, inputs=shards, progress=progress.shown(),
                          name_or_path=plan.source.name) for t in group]
        results = stream_quantize_many(jobs, observers=observers, sinks=sinks, gate=gate)
    out: list[QuantizedComponent | PublishError] = []
    for t, result, fp8, verification, evaluation in zip(group, results, bounds, forwards, evaluations):
        if not isinstance(result, StreamResult):
            out.append(result)
            continue
        try:
            out.append(_streamed(comp, t, result, fp8, verification, evaluation))
        except (PublishError, OSError) as exc:  # its upload failed: this recipe's error, the others go on
            out.append(exc if isinstance(exc, PublishError) else _write_error(t.partial, exc))
    return out


def _streamed(comp: Component, t: RecipeTarget, result: StreamResult, fp8: Fp8Bound | None,
              verification: InPassForward | None, evaluation: InPassForward | None) -> QuantizedComponent:
    """What one recipe's side of a pass made, once its shards are uploaded (a staged push)."""
    dst, uploader = t.dst(comp), t.uploader
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


def _in_pass_forward(src: Path, comp: Component, device: str, spec: ForwardInputs | None,
                     gate: threading.RLock | None = None) -> InPassForward | None:
    """The forward passes of verification, run while the engine holds each tensor (verify/inpass.py): on a CPU,
    for components the run derived forward inputs for (``spec``: verify/capture.py, the same call the checks
    after the pass would replay)."""

    if device != "cpu":
        return None  # the block-by-block forward runs on the CPU; tensors quantized on a GPU stay there
    if spec is None or spec.file is None:
        return None  # weights only (the report says why)
    config = read_object(src / "config.json")
    return InPassForward(comp.library, comp.class_name, config, load_call(spec.file), comp.label, gate=gate)


def _copy_unchanged(plan: Plan, base_dir: Path, out: Path, elsewhere: frozenset[str] = frozenset()) -> None:
    """Everything but the quantized components' weights, the base card (replaced by ours) and ``elsewhere`` (copied
    Hub to Hub), as plain files: a link is read only when it resolves inside the base folder (or the download
    cache's blobs of this repo), and never copied as a link (localfiles)."""

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
