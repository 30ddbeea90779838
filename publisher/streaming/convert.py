"""Streaming quantization: the library path's output, bit for bit, with one tensor in memory at a time.

The documented library path (``from_pretrained(..., quantization_config=TorchAoConfig(...))`` then
``save_pretrained``) holds the whole model in RAM and clones every quantized tensor while saving
(about 4x the bf16 size at peak). Per-row torchao quantization needs no calibration, so each
Linear weight can be quantized on its own: this package plans the output on the meta device,
then reads, quantizes and writes one tensor at a time.

    reason = supports("diffusers", folder, recipe)
    if reason is None:
        result = stream_quantize(StreamJob(folder, out, library="diffusers", recipe=recipe))
    else:
        ...  # library path; log `reason`

Modules: ``job`` (the job and the observer / sink protocols), ``layout`` (names, layout, headers), ``engine`` (the
read/quantize/write loop), ``safetensors_io`` (headers and plain reads/writes). The libraries' own loaders and
quantizers on a meta-device model are publisher/adapters' (one adapter class per library).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from publisher import adapters
from publisher.errors import PublishError, QuantizeError
from publisher.fp8cpu import cpu_quantization_context
from publisher.io.jsonfile import read_object, weight_map
from publisher.recipes import build_config, cuda_capability
from publisher.runtime.heap import peak_rss_bytes
from publisher.streaming.engine import Lane, execute_lanes, remove_stale_shards
from publisher.streaming.fp8blocks import float8_in_row_blocks
from publisher.streaming.layout import build_layout
from publisher.streaming.safetensors_io import read_header
from publisher.streaming.shards import RangeIgnored
from publisher.streaming.streamjob import FolderInputs, FolderSink, StreamJob

if TYPE_CHECKING:
    from publisher.adapters import LibraryAdapter
    from publisher.recipes import Recipe
    from publisher.streaming.engine import Lane
    from publisher.streaming.layout import Layout
    from publisher.streaming.streamjob import OutputSink, ShardInputs, TensorObserver

__all__ = ["StreamJob", "StreamResult", "supports", "stream_quantize", "stream_quantize_many"]


@dataclass
class StreamResult:
    quantized: list[str]  # module names whose weight became a torchao tensor
    skipped: list[str]  # Linear modules torchao left as they were (shape not supported)
    excluded: list[str]  # Linear modules kept by exclusion: `exclude`, plus the library's own default skips
    files: list[Path]  # output files written (config.json, shards, index), in completion order
    peak_rss_bytes: int  # the process's peak RSS so far (ru_maxrss), import of torch & co included
    stage_seconds: dict[str, float]  # plan/read/quantize/write
    digests: dict[str, str]  # state-dict name -> digest of the tensor as it was in memory (loadpath.tensor_digest)
    classes: dict[str, str] = field(default_factory=dict)  # quantized module -> the torchao class of its weight


def _static_reason(library: str, src_dir: Path, recipe: Recipe, device: str) -> str | None:
    """Checks that need no model: library, folder, device and hardware."""

    if library not in adapters.LIBRARIES:
        return f"library {library!r} is not {' or '.join(adapters.LIBRARIES)}"
    if device != "cpu" and not device.startswith("cuda"):
        return f"device {device!r} is not cpu or cuda"
    if not (src_dir / "config.json").is_file():
        return f"{src_dir} has no config.json"
    needs = recipe.quantize
    if device == "cpu":
        if recipe.needs_gpu_to_quantize or (needs.cuda and not _cpu_producible(recipe)):
            return f"{recipe.name} quantizes on a {needs.describe()} only; run it on such a GPU"
        return None
    cc = cuda_capability()
    if cc is None:
        return f"device {device} was requested and this machine has no CUDA GPU"
    if needs.cuda and needs.min_cc and cc < needs.min_cc:
        return f"{recipe.name} needs a {needs.describe()} to quantize; this GPU has {cc[0]}.{cc[1]}"
    return None


def _cpu_producible(recipe: Recipe) -> bool:
    """FP8-dynamic recipes the fp8cpu module can quantize on a CPU (the library path does so too)."""
    try:
        from publisher.fp8cpu import cpu_quantize_supported
    except ImportError:
        return False
    return cpu_quantize_supported(recipe)


def _default_device(recipe: Recipe) -> str:
    """cuda for recipes that need it when a fitting GPU is present, else cpu (the library path's choice)."""

    needs = recipe.quantize
    cc = cuda_capability() if needs.cuda else None
    return "cuda" if cc is not None and (not needs.min_cc or cc >= needs.min_cc) else "cpu"


def _quantize_context(recipe: Recipe, device: str) -> AbstractContextManager[object]:
    """The context the library path quantizes in: fp8cpu's bypass for FP8 recipes on a CPU, else none."""
    from contextlib import nullcontext

    if device == "cpu" and recipe.quantize.cuda:
        return cpu_quantization_context(recipe)
    return nullcontext()


def _component(library: str, src_dir: Path, recipe: Recipe, exclude: Sequence[str], class_name: str | None,
               component: str = "") -> LibraryAdapter:
    """The meta-device component, prepared with the config ``component`` is quantized with (its own, per-component
    and per-layer included)."""

    return adapters.of(library)(src_dir, build_config(recipe, component), list(exclude), class_name)


def _checkpoint_keys(src_dir: Path, comp: LibraryAdapter, inputs: ShardInputs | None) -> dict[str, str] | None:
    """Checkpoint key -> shard name, from the index; a single file is read (fetched if needed) for its header."""

    index = src_dir / comp.index_name
    if index.is_file():
        return weight_map(read_object(index), str(index))
    single = src_dir / comp.weights_name
    if not single.is_file():
        if inputs is None:
            return None
        fetched = inputs.open(comp.weights_name)
        if not isinstance(fetched, (str, Path)):  # an open remote file: only its header is read
            with fetched:
                _, header = read_header(fetched)
            return {k: comp.weights_name for k in header}
        single = Path(fetched)
    _, header = read_header(single)
    return {k: comp.weights_name for k in header}


def supports(library: str, src_dir: Path, recipe: Recipe, *, class_name: str | None = None,
             device: str | None = None, remote_files: Collection[str] = (), component: str = "") -> str | None:
    """None if the streaming engine can handle this component; else the reason (caller falls back to the library path and logs it).

    Needs config.json and the safetensors index (or the single weights file) in ``src_dir``; builds the model on the
    meta device, which takes a second or two and no weights. ``remote_files``: file names ``StreamJob.inputs`` can bring
    (e.g. the Hub listing of this folder), so a single-file checkpoint need not be downloaded to be accepted; its
    key checks then happen in ``stream_quantize``.
    """
    src_dir = Path(src_dir)
    device = device or _default_device(recipe)
    reason = _static_reason(library, src_dir, recipe, device)
    if reason:
        return reason
    try:
        comp = _component(library, src_dir, recipe, (), class_name, component)
    except (ValueError, TypeError, AttributeError, OSError, ImportError) as exc:
        return f"building {src_dir.name or src_dir} on the meta device failed: {exc}"
    keys = _checkpoint_keys(src_dir, comp, None)
    if keys is None:
        if comp.weights_name in remote_files:
            return None
        return f"{src_dir} has neither {comp.index_name} nor {comp.weights_name} (pickle-only or variant checkpoints)"
    reason = comp.check_keys(list(keys))
    if reason:
        return reason
    missing = [k for k in comp.names if k not in keys and k not in comp.dropped_on_save]
    if missing:
        return f"the checkpoint lacks {len(missing)} parameters of {comp.class_name} (e.g. {missing[0]!r}): legacy layout"
    return None


def stream_quantize(job: StreamJob, *, observer: TensorObserver | None = None,
                    sink: OutputSink | None = None) -> StreamResult:
    """Quantize one component folder (``job``: what to read, the recipe, where to write) exactly as from_pretrained +
    save_pretrained would.

    ``observer`` (``job.TensorObserver``) sees every tensor in memory and may choose the reading order (a forward
    pass during quantization, the FP8 error bound); ``sink`` (``job.OutputSink``, default ``FolderSink``) is told the
    layout, may make the writer wait before bytes are written (a disk budget: output shards that leave the disk once
    uploaded) and gets each output file (config, shard, index) once it is complete. The in-memory digests of the
    written tensors come back in ``StreamResult.digests`` (and to the sink while the pass runs).
    On error the files already written stay in ``dst_dir`` (the caller owns the folder).
    """
    (got,) = stream_quantize_many([job], observers=[observer], sinks=[sink])
    if not isinstance(got, StreamResult):
        raise got
    return got


def stream_quantize_many(jobs: Sequence[StreamJob], *, observers: Sequence[TensorObserver | None],
                         sinks: Sequence[OutputSink | None],
                         gate: AbstractContextManager[object] | None = None) -> list[StreamResult | PublishError]:
    """Several recipes of one component folder in one read: every job has the same ``src_dir`` (and its shards come
    from the first job's ``inputs``) and the same device; each has its own recipe, output folder, observer and sink.
    Each tensor is read once and handed to every recipe in turn. A recipe whose planning or step fails is dropped
    from the pass and its error returned in its place (the others go on); a failure of the read itself raises.
    Lists in the order of ``jobs``; what ``stream_quantize`` says of one job holds for each. ``gate`` (a re-entrant
    lock): held over each quantize call, shared with the observers' forward checks (verify/inpass.py): one at a time."""

    src_dir = Path(jobs[0].src_dir)
    if any(Path(j.src_dir) != src_dir for j in jobs):
        raise ValueError("the jobs of one pass read different folders")  # a caller's bug
    inputs = jobs[0].inputs or FolderInputs(src_dir)
    got: list[_Prepared | PublishError] = []
    keys: dict[str, str] | None = None
    for job, observer, sink in zip(jobs, observers, sinks):
        try:
            ready = _prepare(job, inputs, keys, observer, sink or FolderSink())
            ready.lane.gate = gate
            keys = ready.keys
            got.append(ready)
        except PublishError as exc:  # this recipe cannot be planned; the others go on
            got.append(exc)
    lanes = [p.lane for p in got if isinstance(p, _Prepared)]
    if lanes:
        with ExitStack() as stack:
            stack.enter_context(float8_in_row_blocks())  # float8 weights without torchao's fp32 temporaries, same bytes
            for p in got:
                if isinstance(p, _Prepared):
                    stack.enter_context(_quantize_context(p.job.recipe, p.device))
            try:
                execute_lanes(lanes, inputs=inputs, progress=jobs[0].progress)
            except EOFError as exc:
                raise QuantizeError(f"{exc}; fetch the shard again") from exc
            except RangeIgnored as exc:
                raise QuantizeError(str(exc)) from exc
            except OSError as exc:
                into = ", ".join(str(j.dst_dir) for j in jobs)
                raise QuantizeError(f"streaming {src_dir} into {into} failed: {exc}") from exc
    return [p if not isinstance(p, _Prepared) else p.finish(peak_rss_bytes()) for p in got]


@dataclass
class _Prepared:
    """One job of a pass, planned: its meta-device component, layout and lane (its outputs and what it reports to)."""

    job: StreamJob
    comp: LibraryAdapter
    plan: Layout
    device: str
    keys: dict[str, str]
    lane: Lane
    written: list[Path]

    def finish(self, peak: int) -> StreamResult | PublishError:
        """After the pass: the index, and what it made; or why this job failed."""
        dst_dir, exc = Path(self.job.dst_dir), self.lane.error
        try:
            if exc is not None:
                raise exc
            if self.plan.index is not None:
                t0 = time.perf_counter()
                index = dst_dir / self.comp.index_name
                index.write_text(self.plan.index, encoding="utf-8")
                self.lane.seconds["write"] += time.perf_counter() - t0
                self.written.append(index)
                self.lane.report(index)
        except PublishError as failed:
            return failed
        except OSError as failed:  # the pass reports such errors of its writers here, per job
            return QuantizeError(f"streaming {self.job.src_dir} into {dst_dir} failed: {failed}")
        plan = self.plan
        return StreamResult(quantized=plan.quantized, skipped=plan.skipped, excluded=plan.excluded, files=self.written,
                            peak_rss_bytes=peak, stage_seconds=self.lane.seconds, digests=self.lane.digests,
                            classes=dict(plan.classes))


def _prepare(job: StreamJob, inputs: ShardInputs, keys: dict[str, str] | None, observer: TensorObserver | None,
             sink: OutputSink) -> _Prepared:
    """Plan ``job`` on the meta device, tell its sink the layout, write its configs (``keys``: the checkpoint's keys
    when another job of the pass read them already)."""

    t_start = time.perf_counter()
    recipe = job.recipe
    src_dir, dst_dir = Path(job.src_dir), Path(job.dst_dir)
    device = job.device or _default_device(recipe)
    reason = _static_reason(job.library, src_dir, recipe, device)
    if reason:
        raise QuantizeError(f"the streaming engine cannot quantize {src_dir}: {reason}; use the library path")
    try:
        comp = _component(job.library, src_dir, recipe, job.exclude, job.class_name, job.component)
        if job.name_or_path is not None:
            comp.record_origin(job.name_or_path)
        keys = keys if keys is not None else _checkpoint_keys(src_dir, comp, inputs)
        if keys is None:
            raise ValueError(f"{src_dir} has neither {comp.index_name} nor {comp.weights_name}")
        if why := comp.check_keys(list(keys)):
            raise ValueError(why)
        # Probing on the meta device is free, but fp8cpu's bypass and GPU handlers want real tensors.
        probe_device = "meta" if device == "cpu" and not recipe.quantize.cuda else device
        with _quantize_context(recipe, device):
            plan = build_layout(comp, keys, device, probe_device, set(recipe.classes_for(job.component)),
                                job.max_shard_size)
    except RangeIgnored as exc:  # the server, not the model: the message says what to do
        raise QuantizeError(str(exc)) from exc
    except (ValueError, TypeError, AttributeError, OSError, ImportError, RuntimeError, AssertionError) as exc:
        raise QuantizeError(f"planning the streaming quantization of {src_dir} with {recipe.name} failed: {exc}; "
                            "use the library path") from exc
    seconds = {"plan": time.perf_counter() - t_start, "read": 0.0, "quantize": 0.0, "write": 0.0}

    written: list[Path] = []
    digests: dict[str, str] = {}
    files: dict[str, set[str]] = {}
    for w in plan.work:
        for out in w.outputs:
            files.setdefault(w.key if w.kind != "pass" else out.name, set()).add(out.file)
    sink.planned(files, digests)

    def report(path: Path) -> None:
        written.append(path)
        sink.written(path)

    try:
        dst_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_shards(dst_dir, comp.weights_name, {f.name for f in plan.files})
        t0 = time.perf_counter()
        for path in comp.write_configs(dst_dir):
            report(path)
        seconds["write"] += time.perf_counter() - t0
    except OSError as exc:
        raise QuantizeError(f"streaming {src_dir} into {dst_dir} failed: {exc}") from exc
    lane = Lane(plan, dst_dir, report, sink.reserve, seconds, digests, observer)
    return _Prepared(job, comp, plan, device, keys, lane, written)
