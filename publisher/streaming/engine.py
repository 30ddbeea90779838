"""Execution: read one checkpoint tensor, quantize or cast it, write it at its planned offset, free it.

Three threads overlap: the reader (feed.py) reads the next tensors while this thread quantizes tensor k and the
writer hashes and writes tensor k-1. Input shards come in name order (fetched, fully read, released) unless an
observer asks for another order (a forward pass run during quantization: every shard is then read by HTTP
range or from local files, tensor by tensor in execution order). Outputs are written with ``seek`` at the
offsets the plan fixed, so the input order does not have to match the output order; an output shard is
reported as soon as its last tensor lands.
"""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from publisher.errors import PublishError, QuantizeError
from publisher.loadpath import digest_header, digest_parts
from publisher.runtime.heap import bound_heap, trim_memory
from publisher.streaming import safetensors_io as stio
from publisher.streaming.feed import Feed, Item
from publisher.streaming.layout import Layout, OutFile, OutTensor, Work

if TYPE_CHECKING:
    import torch

    from publisher.streaming.streamjob import ShardInputs, TensorObserver


class _Writer:
    """One background thread that hashes and writes quantized tensors in submission order, so that the next
    tensor's read and quantization overlap them (hashlib, file writes and torch kernels release the GIL).
    At most one job waits while one runs: two tensors' bytes at most, whatever the model size."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        seconds.setdefault("wait_writer", 0.0)  # the engine waiting for the writer to take a job
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hf-ao-publish-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job is None:
                    return
                if self.error is None:
                    job()
            except BaseException as exc:  # handed to the main thread by the next submit/drain
                self.error = exc
            finally:
                self.jobs.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            exc, self.error = self.error, None
            raise exc

    def submit(self, job: Callable[[], None]) -> None:
        self._raise()
        t0 = time.perf_counter()
        self.jobs.put(job)
        self.seconds["wait_writer"] += time.perf_counter() - t0

    def drain(self) -> None:
        """Wait until every submitted job is done (before anything else writes, and at the end)."""
        self.jobs.join()
        self._raise()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class _Outputs:
    """(writer thread) Open output shards, how many tensors each still waits for, and the completion callback."""

    def __init__(self, dst: Path, files: list[OutFile], on_complete: Callable[[Path], None],
                 reserve: Callable[[Path, int], None]) -> None:
        self.dst = dst
        self.files = {f.name: f for f in files}
        self.remaining = {f.name: len(f.entries) for f in files}
        self.handles: dict[str, BinaryIO] = {}
        self.on_complete = on_complete
        self.reserve = reserve

    def handle(self, name: str) -> BinaryIO:
        if name not in self.handles:
            header = self.files[name].header
            self.reserve(self.dst / name, len(header))
            f = open(self.dst / name, "wb")  # noqa: SIM115 - closed in done()/close()
            f.write(header)  # the header is final: every size is planned
            self.handles[name] = f
        return self.handles[name]

    def write(self, name: str, offset: int, data: memoryview) -> None:
        f = self.handle(name)
        self.reserve(self.dst / name, len(data))
        f.seek(offset)
        f.write(data)

    def done(self, entry: OutTensor) -> None:
        self.remaining[entry.file] -= 1
        if self.remaining[entry.file] == 0:
            f = self.handle(entry.file)  # opens it if the file only holds empty tensors
            f.truncate(self.files[entry.file].size)  # exact size even if the last tensor is empty
            f.close()
            del self.handles[entry.file]
            self.on_complete(self.dst / entry.file)

    def close(self) -> None:
        for f in self.handles.values():
            f.close()
        self.handles.clear()


def remove_stale_shards(dst: Path, weights_name: str, keep: set[str]) -> None:
    """save_pretrained deletes shard files of an earlier save that the new layout does not use; so do we."""
    stem = weights_name.removesuffix(".safetensors")
    pattern = re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\.safetensors")
    for p in dst.iterdir():
        if p.is_file() and pattern.fullmatch(p.name) and p.name not in keep:
            p.unlink()


@dataclass
class Lane:
    """One output of a pass: a recipe's layout, its output folder, and what it reports to. Several lanes share one
    read of the checkpoint (one recipe each, ``execute_lanes``); ``error`` is why a lane was dropped from the pass."""

    plan: Layout
    dst: Path
    report: Callable[[Path], None]
    reserve: Callable[[Path, int], None]
    seconds: dict[str, float]
    digests: dict[str, str]
    observer: TensorObserver | None = None
    error: PublishError | OSError | None = None
    gate: AbstractContextManager[Any] | None = None  # held over each quantize call (shared with the lanes' observers)


def execute(plan: Layout, dst: Path, *, inputs: ShardInputs, report: Callable[[Path], None],
            reserve: Callable[[Path, int], None], progress: bool, seconds: dict[str, float], digests: dict[str, str],
            observer: TensorObserver | None = None) -> None:
    """Stream every planned tensor from the input shards into the output shards.

    ``inputs.open(name)`` returns a local path or an open binary file (a Hub file read by HTTP range);
    ``digests`` collects the verification digest of every tensor as it was in memory; ``observer`` sees every
    tensor and may choose the order; ``report(path)`` is called (on the writer thread) once an output shard is
    complete, ``reserve(path, nbytes)`` before bytes are written to it, and may wait (a disk budget)."""
    lane = Lane(plan, dst, report, reserve, seconds, digests, observer)
    execute_lanes([lane], inputs=inputs, progress=progress)
    if lane.error is not None:
        raise lane.error


def execute_lanes(lanes: list[Lane], *, inputs: ShardInputs, progress: bool) -> None:
    """One read of the checkpoint for every lane: each tensor read once, then quantized, observed and written by each
    lane in turn (its own writer thread and output shards). A lane whose step fails (PublishError, OSError) is dropped
    with the reason in ``Lane.error``, the others go on; the pass stops when no lane is left. Every lane reads the same
    keys from the same files (one component, several recipes); the first lane's layout sets the reading schedule."""
    from huggingface_hub.utils import tqdm

    bound_heap()
    first = lanes[0].plan
    for lane in lanes[1:]:
        if {(w.key, w.src_file) for w in lane.plan.work} != {(w.key, w.src_file) for w in first.work}:
            raise QuantizeError("the recipes of one pass read different checkpoint tensors (internal planning error)")
    ctxs = [_Ctx(lane.plan, _Outputs(lane.dst, lane.plan.files, lane.report, lane.reserve), lane.seconds, lane.digests,
                 _Writer(lane.seconds), lane.observer, lane.gate) for lane in lanes]
    live = list(ctxs)
    order = _begin(ctxs, [w.key for w in first.work if w.outputs])
    feed = Feed(first, inputs, order=order, whole=lambda key: any(c.whole(key) for c in ctxs), seconds=lanes[0].seconds)
    total = sum(o.nbytes for f in first.files for o in f.entries)
    since_trim, ok = 0, False
    try:
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"quantize {first.component.class_name}",
                  disable=not progress, file=sys.stderr) as bar:
            for item in feed:
                for ctx in list(live):
                    try:
                        w = ctx.work[item.work.key]
                        if item.chunk_at >= 0:
                            _chunk(ctx, w, item)
                        else:
                            _one(ctx, w, item.entry, item.raw)
                    except (PublishError, OSError) as exc:  # this lane's recipe fails; the others go on
                        _drop(ctx, exc, live)
                done = sum(o.nbytes for o in item.work.outputs) if item.last else 0
                bar.update(done)
                since_trim += done
                if since_trim > TRIM_EVERY:
                    trim_memory()
                    since_trim = 0
                del item
                if not live:
                    break
        for ctx in list(live):
            try:
                ctx.writer.drain()
            except (PublishError, OSError) as exc:
                _drop(ctx, exc, live)
        ok = True
    finally:
        feed.close()
        for ctx in ctxs:
            ctx.close(ok and ctx.error is None)
    trim_memory()
    for lane, ctx in zip(lanes, ctxs):
        lane.seconds.update({k: lanes[0].seconds[k] for k in ("read", "wait_input")})  # the shared read's
        unfinished = [n for n, left in ctx.outputs.remaining.items() if left]
        if ctx.error is None and unfinished:
            ctx.error = QuantizeError(f"output shard {unfinished[0]} was not completed (internal planning error); "
                                      "use the library path")
        lane.error = ctx.error


def _begin(ctxs: list[_Ctx], readable: list[str]) -> list[str] | None:
    """The reading order: the first order an observer asks for. Every lane's observer plans the same component's
    forward, so they agree; one that asked for another order could not follow this pass and stops at once."""
    order: list[str] | None = None
    for ctx in ctxs:
        planned = ctx.observer.begin(readable) if ctx.observer is not None else None
        if planned is None or order is None or planned == order:
            order = order or planned
            continue
        ctx.observer.end(False)  # type: ignore[union-attr]
        ctx.observer = None
    return order


def _drop(ctx: _Ctx, exc: PublishError | OSError, live: list[_Ctx]) -> None:
    """A lane's step failed: it leaves the pass now (its writer, files and observer closed), its reason kept."""
    live.remove(ctx)
    ctx.error = exc
    ctx.close(False)


TRIM_EVERY = 1 << 30  # hand freed heap back to the OS after about this many bytes


class _Ctx:
    """What every tensor's step shares."""

    def __init__(self, plan: Layout, outputs: _Outputs, seconds: dict[str, float], digests: dict[str, str],
                 writer: _Writer, observer: TensorObserver | None, gate: AbstractContextManager[Any] | None = None) -> None:
        self.plan, self.outputs, self.seconds, self.digests = plan, outputs, seconds, digests
        self.writer, self.observer = writer, observer
        self.gate = gate or nullcontext()
        seconds.setdefault("forward_handoff", 0.0)
        self.partial: dict[str, Any] = {}  # (writer thread) running digests of tensors copied in chunks
        self.work = {w.key: w for w in plan.work}
        self.error: PublishError | OSError | None = None
        self.closed = False

    def whole(self, key: str) -> bool:
        """Whether this lane needs ``key`` in one piece: its observer does, or it quantizes it (chunks are for
        pass-through tensors only, and another lane may quantize what the first passes through)."""
        w = self.work.get(key)
        return (self.observer is not None and self.observer.wants(key)) or (w is not None and w.kind != "pass")

    def close(self, ok: bool) -> None:
        """Stop the writer (after the job it runs), close the output files, end the observer; once."""
        if self.closed:
            return
        self.closed = True
        try:
            self.writer.close()
            self.outputs.close()
        finally:
            if self.observer is not None:
                self.observer.end(ok)


def _check_entry(ctx: _Ctx, w: Work, entry: stio.HeaderEntry) -> torch.dtype:
    comp = ctx.plan.component
    src_dtype = stio.torch_dtype(entry.dtype)
    if entry.shape != w.shape:
        raise QuantizeError(
            f"{w.key} has shape {list(entry.shape)} in the checkpoint but {list(w.shape)} in the model config; "
            "the checkpoint does not match its config.json"
        )
    # The loader's dtype rule, applied to the real checkpoint dtype, must give what the plan assumed
    # from the meta model (it can differ only for odd checkpoints, e.g. float8 or int buffers cast).
    expected = comp.pass_dtype(w.key, src_dtype)
    if expected != w.dtype:
        raise QuantizeError(
            f"{w.key} is {src_dtype} in the checkpoint, which the library would save as {expected}, not {w.dtype}; "
            "use the library path for this component"
        )
    return src_dtype


def _chunk(ctx: _Ctx, w: Work, item: Item) -> None:
    """One chunk of a large pass-through tensor (e.g. a big embedding): cast, then hashed and written at its place."""
    entry = item.entry
    src_dtype = _check_entry(ctx, w, entry)
    out = w.outputs[0]
    t0 = time.perf_counter()
    # Element-wise casts (round-to-nearest-even) give the same bits chunked or whole.
    data = item.raw.view(src_dtype).to(w.dtype) if src_dtype != w.dtype else item.raw.view(src_dtype)
    ctx.seconds["quantize"] += time.perf_counter() - t0
    at = item.chunk_at // src_dtype.itemsize * w.dtype.itemsize
    ctx.writer.submit(lambda: _write_chunk(ctx, out, at, data, item.last))


def _write_chunk(ctx: _Ctx, out: OutTensor, at: int, data: torch.Tensor, last: bool) -> None:
    t0 = time.perf_counter()
    h = ctx.partial.get(out.name) or digest_header(out.dtype, out.shape)
    ctx.partial[out.name] = h
    view = stio.tensor_bytes(data)
    h.update(view)
    ctx.outputs.write(out.file, out.offset + at, view)
    if last:
        ctx.digests[out.name] = ctx.partial.pop(out.name).hexdigest()
        ctx.outputs.done(out)
    ctx.seconds["write"] += time.perf_counter() - t0


def _one(ctx: _Ctx, w: Work, entry: stio.HeaderEntry, raw: torch.Tensor) -> None:
    _check_entry(ctx, w, entry)
    if w.kind == "pass":
        out = w.outputs[0]
        t0 = time.perf_counter()
        value = raw.to(w.dtype)  # element-wise cast: the same bits as chunked
        ctx.seconds["quantize"] += time.perf_counter() - t0
        _observe(ctx, w.key, value, value)
        ctx.writer.submit(lambda: _write(ctx, out.name, None, [out.name], [(out, value)]))
        return
    t1 = time.perf_counter()
    handoff = ctx.seconds["forward_handoff"]
    parts, meta, subclass, inner = _quantize(ctx, w, raw)
    handoff = ctx.seconds["forward_handoff"] - handoff  # time the observer held the engine up: not quantizing
    del raw
    t2 = time.perf_counter()
    writes = []
    for out in w.outputs:
        t = parts.pop(out.name)
        if t.dtype != out.dtype or tuple(t.shape) != out.shape:
            raise QuantizeError(
                f"torchao produced {out.name} as {t.dtype}{list(t.shape)}, planned {out.dtype}{list(out.shape)}; "
                "this config's layout depends on the data: use the library path"
            )
        writes.append((out, t))
    if parts or meta != w.metadata:
        raise QuantizeError(f"torchao's metadata for {w.key} differs from the planned one; use the library path")
    ctx.seconds["quantize"] += t2 - t1 - handoff
    ctx.writer.submit(lambda: _write(ctx, w.key, subclass, inner, writes))


def _observe(ctx: _Ctx, key: str, value: torch.Tensor, stored: torch.Tensor) -> None:
    """Hand a tensor to the observer; the time it takes (its backpressure included) is counted on its own."""
    if ctx.observer is None:
        return
    t0 = time.perf_counter()
    ctx.observer.tensor(key, value, stored)
    ctx.seconds["forward_handoff"] += time.perf_counter() - t0


def _write(ctx: _Ctx, key: str, subclass: str | None, inner: list[str], writes: list[tuple[OutTensor, torch.Tensor]]) -> None:
    """(writer thread) Hash the tensor as it was in memory, then write its parts at their planned offsets."""

    t0 = time.perf_counter()
    by_name = {out.name: t for out, t in writes}
    # the in-memory tensor's digest: what every reload must reproduce (streaming verification)
    ctx.digests[key] = digest_parts(subclass, [by_name[n] for n in inner])
    for out, t in writes:
        ctx.outputs.write(out.file, out.offset, stio.tensor_bytes(t.cpu()))
        ctx.outputs.done(out)
    ctx.seconds["write"] += time.perf_counter() - t0


def _quantize(ctx: _Ctx, w: Work, raw: torch.Tensor) -> tuple[dict[str, torch.Tensor], str, str | None, list[str]]:
    """Cast like the loader, run the library's quantize call on the model's own Linear, flatten like save.

    Returns the flattened parts, the torchao metadata, and what ``digest_parts`` needs: the subclass name
    (None for a plain tensor) and the part names in ``__tensor_flatten__`` order."""
    import torch
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    plan = ctx.plan
    comp = plan.component
    value = raw.to(w.dtype).contiguous()  # the loaders' `param.to(dtype)`; a no-op for bf16 checkpoints
    device = torch.device(plan.device)
    try:
        with ctx.gate:
            weight = comp.quantize_param(w.key, value, device)
        _observe(ctx, w.key, value, weight.detach())
        del value
        flat, meta = flatten_tensor_state_dict({w.key: weight.detach()})  # as state_dict() hands it over
        if type(weight) is torch.Tensor or type(weight) is torch.nn.Parameter:
            subclass, inner = None, [w.key]
        else:  # the parts flatten_tensor_state_dict cloned, named as it names them
            module, attr = w.key.rsplit(".", 1)
            subclass, inner = type(weight).__name__, [f"{module}._{attr}_{n}" for n in weight.__tensor_flatten__()[0]]
        del weight
    except (RuntimeError, ValueError, TypeError, AssertionError, NotImplementedError, ImportError) as exc:
        raise QuantizeError(f"quantizing {w.key} on {plan.device} failed: {exc}") from exc
    finally:
        comp.detach_weight(w.key)
    if w.kind == "skip" and json.loads(meta[w.key]).get("_type") != "Tensor":
        raise QuantizeError(f"torchao quantized {w.key}, which it left alone at planning time; use the library path")
    return dict(flat), meta[w.key], subclass, inner
