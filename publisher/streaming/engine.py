"""Execution: read one checkpoint tensor, quantize or cast it, write it at its planned offset, free it.

Input shards are consumed one at a time in name order (fetched, fully read, released), so the disk
holds one input shard plus the output shards still being filled. Outputs are written with
``seek`` at the offsets the plan fixed, so the input order does not have to match the output
order; an output shard is reported as soon as its last tensor lands.
"""

from __future__ import annotations

import json
import queue
import re
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from publisher.errors import QuantizeError
from publisher.localfiles import open_regular
from publisher.streaming import safetensors_io as stio
from publisher.streaming.layout import OutFile, OutTensor, Plan, Work


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps freed blocks of up to 32 MB in its arenas, which
    then count as RSS); a no-op elsewhere. Tensors are freed by reference counting, so no gc pass."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _Sink:
    """One background thread that hashes and writes quantized tensors in submission order, so that the next
    tensor's read and quantization overlap them (hashlib, file writes and torch kernels release the GIL).
    At most one job waits while one runs: two tensors' bytes at most, whatever the model size."""

    def __init__(self) -> None:
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
        self.jobs.put(job)

    def drain(self) -> None:
        """Wait until every submitted job is done (before anything else writes, and at the end)."""
        self.jobs.join()
        self._raise()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class _Outputs:
    """Open output shards, how many tensors each still waits for, and the completion callback."""

    def __init__(self, dst: Path, files: list[OutFile], on_complete: Callable[[Path], None]) -> None:
        self.dst = dst
        self.files = {f.name: f for f in files}
        self.remaining = {f.name: len(f.entries) for f in files}
        self.handles: dict[str, BinaryIO] = {}
        self.on_complete = on_complete

    def handle(self, name: str) -> BinaryIO:
        if name not in self.handles:
            f = open(self.dst / name, "wb")  # noqa: SIM115 - closed in done()/close()
            f.write(self.files[name].header)  # the header is final: every size is planned
            self.handles[name] = f
        return self.handles[name]

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


def execute(plan: Plan, dst: Path, *, fetch_shard: Callable[[str], Any],
            release_shard: Callable[[Any], None], report: Callable[[Path], None], progress: bool,
            seconds: dict[str, float], digests: dict[str, str] | None = None,
            on_tensor: Callable[[str, Any, Any], None] | None = None) -> None:
    """Stream every planned tensor from the input shards into the output shards.

    ``fetch_shard(name)`` returns a local path or an open binary file (a Hub file read by HTTP
    range); ``digests`` collects the verification digest of every tensor as it was in memory;
    ``on_tensor(key, value, quantized)`` sees each weight before and after quantization."""
    from huggingface_hub.utils import tqdm

    outputs = _Outputs(dst, plan.files, report)
    sink = _Sink()
    ctx = _Ctx(plan, outputs, seconds, digests if digests is not None else {}, on_tensor, sink)
    try:
        for name in plan.input_files:
            src = fetch_shard(name)
            local = isinstance(src, (str, Path))
            f = open_regular(Path(src)) if local else src  # never blocks on a FIFO; closed below
            try:
                _, header = stio.read_header(f, str(src) if local else None)
                items = [w for w in plan.work if w.src_file == name]
                missing = [w.key for w in items if w.key not in header]
                if missing:
                    raise QuantizeError(f"{name} has no tensor {missing[0]!r} although the index lists it; re-download the shard")
                # File order: sequential reads, and one running hash of a remote shard covers its header, every
                # tensor and the bytes between them (integrity.HashedReader) while one tensor is held at a time.
                items.sort(key=lambda w: header[w.key].begin)
                total = sum(header[w.key].end - header[w.key].begin for w in items)
                with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"quantize {name}",
                          disable=not progress, file=sys.stderr) as bar:
                    for w in items:
                        bar.set_postfix_str(w.key, refresh=False)
                        _one(ctx, w, header[w.key], f)
                        bar.update(header[w.key].end - header[w.key].begin)
                sink.drain()
                release_shard(src)  # still open: the caller may read the rest (its hash check) before it is closed
            finally:
                f.close()
            trim_memory()
    finally:
        sink.close()
        outputs.close()
    unfinished = [n for n, left in outputs.remaining.items() if left]
    if unfinished:
        raise QuantizeError(f"output shard {unfinished[0]} was not completed (internal planning error); use the library path")


class _Ctx:
    """What every tensor's step shares."""

    def __init__(self, plan: Plan, outputs: _Outputs, seconds: dict[str, float], digests: dict[str, str],
                 on_tensor: Callable[[str, Any, Any], None] | None, sink: _Sink) -> None:
        self.plan, self.outputs, self.seconds, self.digests, self.on_tensor = plan, outputs, seconds, digests, on_tensor
        self.sink = sink


def _one(ctx: _Ctx, w: Work, entry: stio.HeaderEntry, f: BinaryIO) -> None:
    plan, outputs, seconds = ctx.plan, ctx.outputs, ctx.seconds
    comp = plan.component
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
    if w.kind == "pass":
        if not w.outputs:  # tied weights are read by nobody and saved under their other name
            return
        out = w.outputs[0]
        if entry.end - entry.begin > stio.CHUNK_BYTES:  # e.g. a big embedding: copied chunk by chunk, here
            ctx.sink.drain()  # copy_cast writes in this thread: nothing may write concurrently
            ctx.digests[out.name] = stio.copy_cast(f, entry, outputs.handle(out.file), out.offset, w.dtype, seconds)
            outputs.done(out)
            return
        t0 = time.perf_counter()
        value = stio.read_tensor(f, entry).to(w.dtype)  # element-wise cast: the same bits as chunked
        seconds["read"] += time.perf_counter() - t0
        ctx.sink.submit(lambda: _write(ctx, out.name, None, [out.name], [(out, value)]))
        return
    t0 = time.perf_counter()
    raw = stio.read_tensor(f, entry)
    t1 = time.perf_counter()
    parts, meta, subclass, inner = _quantize(ctx, w, raw)
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
    seconds["read"] += t1 - t0
    seconds["quantize"] += t2 - t1
    ctx.sink.submit(lambda: _write(ctx, w.key, subclass, inner, writes))


def _write(ctx: _Ctx, key: str, subclass: str | None, inner: list[str], writes: list[tuple[OutTensor, Any]]) -> None:
    """(writer thread) Hash the tensor as it was in memory, then write its parts at their planned offsets."""
    from publisher.loadpath import digest_parts

    t0 = time.perf_counter()
    by_name = {out.name: t for out, t in writes}
    # the in-memory tensor's digest: what every reload must reproduce (streaming verification)
    ctx.digests[key] = digest_parts(subclass, [by_name[n] for n in inner])
    for out, t in writes:
        fh = ctx.outputs.handle(out.file)
        fh.seek(out.offset)
        fh.write(stio.tensor_bytes(t.cpu()))
        ctx.outputs.done(out)
    ctx.seconds["write"] += time.perf_counter() - t0


def _quantize(ctx: _Ctx, w: Work, raw: Any) -> tuple[dict[str, Any], str, str | None, list[str]]:
    """Cast like the loader, run the library's quantize call on the model's own Linear, flatten like save.

    Returns the flattened parts, the torchao metadata, and what ``digest_parts`` needs: the subclass name
    (None for a plain tensor) and the part names in ``__tensor_flatten__`` order."""
    """Cast like the loader, run the library's quantize call on the model's own Linear, flatten like save."""
    import torch
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    plan = ctx.plan
    comp = plan.component
    value = raw.to(w.dtype).contiguous()  # the loaders' `param.to(dtype)`; a no-op for bf16 checkpoints
    device = torch.device(plan.device)
    try:
        weight = comp.quantize_param(w.key, value, device)
        if ctx.on_tensor is not None:
            ctx.on_tensor(w.key, value, weight)
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
