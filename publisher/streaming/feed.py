"""The engine's input side: which checkpoint tensor comes next, read ahead (up to AHEAD_BYTES) on a thread of its own.

Two orders:

- **file order** (the default): input shards one at a time in name order, each tensor by its offset (sequential
  reads); a shard is fetched when its first tensor is due and released as soon as its last one is read, so a
  caller that downloads shards holds one of them at a time.
- **a given order** (``order``: checkpoint keys, e.g. the order a forward pass uses them): every shard is opened
  at the start (by HTTP range, or local files) and the listed keys come first, the rest after them in file order.
  Over HTTP range every tensor is one request anyway, so the order costs no extra bytes.

The reader thread reads ahead while the engine quantizes tensor k (file reads and HTTP transfers release the
GIL): as many tensors as fit in ``AHEAD_BYTES``, or one if it alone is larger, so the engine holds at most its own
tensor and that much more. One tensor ahead was the rule before; measured in a publish reading by HTTP range in
execution order, the engine then waited for its reader a third of the pass, small tensors' requests (norms, biases)
each paying a round trip the engine could not hide. A pass-through
tensor larger than ``CHUNK_BYTES`` that nobody needs whole (e.g. a big embedding) arrives in chunks instead.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from publisher.errors import QuantizeError
from publisher.io.localfiles import open_regular
from publisher.streaming import safetensors_io as stio
from publisher.streaming.layout import Layout, Work

if TYPE_CHECKING:
    import torch

    from publisher.streaming.streamjob import Shard, ShardInputs


@dataclass
class Item:
    """One tensor (or one chunk of a large pass-through tensor) read from the checkpoint."""

    work: Work
    entry: stio.HeaderEntry
    raw: torch.Tensor  # the tensor as stored; for a chunk, its raw bytes (uint8)
    chunk_at: int = -1  # byte offset of a chunk inside the tensor; -1: the whole tensor
    last: bool = True  # the last chunk of its tensor


@dataclass
class _Shard:
    name: str
    src: Shard  # what ShardInputs.open returned (a path, or an open remote file)
    handle: BinaryIO
    header: dict[str, stio.HeaderEntry]
    left: int  # items still to read from it


AHEAD_BYTES = 96 << 20  # about one of FLUX.1-dev's largest tensors (94 MB)


class Feed:
    """Iterate over ``Item``s in the planned order; ``close()`` stops the reader (always call it)."""

    def __init__(self, plan: Layout, inputs: ShardInputs, *, order: list[str] | None = None,
                 whole: Callable[[str], bool] = lambda key: False, seconds: dict[str, float] | None = None) -> None:
        self.plan, self.inputs, self.order, self.whole = plan, inputs, order, whole
        self.seconds = seconds if seconds is not None else {}
        self.seconds.setdefault("read", 0.0)
        self.seconds.setdefault("wait_input", 0.0)
        self._q: queue.Queue[Item | BaseException | None] = queue.Queue()  # bounded by AHEAD_BYTES, not by count
        self._room = threading.Condition()
        self._ahead = 0  # bytes read and not yet taken by the engine
        self._stop = threading.Event()
        self._open: dict[str, _Shard] = {}
        self._thread = threading.Thread(target=self._run, name="hf-ao-publish-reader", daemon=True)
        self._thread.start()

    # ---- consumer side (the engine's thread)
    def __iter__(self) -> Iterator[Item]:
        while True:
            t0 = time.perf_counter()
            got = self._q.get()
            self.seconds["wait_input"] += time.perf_counter() - t0  # the engine idle, waiting for the reader
            if isinstance(got, Item):
                self._taken(got.raw.numel() * got.raw.element_size())
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield got

    def _taken(self, nbytes: int) -> None:
        with self._room:
            self._ahead -= nbytes
            self._room.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._room:
            self._room.notify_all()
        while self._thread.is_alive():
            try:
                self._q.get(timeout=0.05)
            except queue.Empty:
                pass
        for shard in list(self._open.values()):
            self._done_with(shard, release=False)

    # ---- the reader thread
    def _run(self) -> None:
        try:
            for work, shard in self._sequence():
                if self._stop.is_set():
                    return
                self._read(work, shard)
                shard.left -= 1
                if shard.left == 0:
                    self._done_with(shard, release=True)
            self._put(None)
        except BaseException as exc:  # handed to the engine's thread, which raises it
            self._put(exc)

    def _put(self, item: Item | BaseException | None) -> None:
        if not self._stop.is_set():
            self._q.put(item)

    def _wait_turn(self, nbytes: int) -> bool:
        """Wait until ``nbytes`` more fit in AHEAD_BYTES (or nothing is ahead), then count them as read ahead."""
        with self._room:
            while self._ahead and self._ahead + nbytes > AHEAD_BYTES and not self._stop.is_set():
                self._room.wait(0.1)
            self._ahead += nbytes
        return not self._stop.is_set()

    def _read(self, work: Work, shard: _Shard) -> None:
        entry = shard.header[work.key]
        size = entry.end - entry.begin
        if work.kind == "pass" and size > stio.CHUNK_BYTES and not self.whole(work.key):
            step = stio.chunk_step(entry)
            for at in range(0, size, step):
                if not self._wait_turn(min(step, size - at)):
                    return
                t0 = time.perf_counter()
                raw = stio.read_bytes(shard.handle, entry.begin + at, min(step, size - at))
                self.seconds["read"] += time.perf_counter() - t0
                self._put(Item(work, entry, raw, at, at + step >= size))
            return
        if not self._wait_turn(size):
            return
        t0 = time.perf_counter()
        raw = stio.read_tensor(shard.handle, entry)
        self.seconds["read"] += time.perf_counter() - t0
        self._put(Item(work, entry, raw))

    def _shard(self, name: str, items: list[Work]) -> _Shard:
        src = self.inputs.open(name)
        local = isinstance(src, (str, Path))
        # never blocks on a FIFO; closed in _done_with
        handle = open_regular(Path(src)) if isinstance(src, (str, Path)) else src
        _, header = stio.read_header(handle, str(src) if local else None)
        missing = [w.key for w in items if w.key not in header]
        if missing:
            handle.close()
            raise QuantizeError(f"{name} has no tensor {missing[0]!r} although the index lists it; re-download the shard")
        shard = _Shard(name, src, handle, header, sum(1 for w in items if w.outputs))
        self._open[name] = shard
        return shard

    def _done_with(self, shard: _Shard, release: bool) -> None:
        self._open.pop(shard.name, None)
        try:
            if release:  # still open: the caller may read the rest (its hash check) before it is closed
                self.inputs.release(shard.src)
        finally:
            shard.handle.close()

    def _sequence(self) -> Iterator[tuple[Work, _Shard]]:
        """(work item, its open shard) in processing order; tied keys (saved under another name) are never read."""
        by_file: dict[str, list[Work]] = {}
        for w in self.plan.work:
            by_file.setdefault(w.src_file, []).append(w)
        if self.order is None:
            for name in self.plan.input_files:
                shard = self._shard(name, by_file.get(name, []))
                items = sorted((w for w in by_file.get(name, []) if w.outputs), key=lambda w: shard.header[w.key].begin)
                if not items:
                    self._done_with(shard, release=True)
                for w in items:
                    yield w, shard
            return
        shards = {name: self._shard(name, by_file.get(name, [])) for name in self.plan.input_files}
        for shard in [s for s in shards.values() if s.left == 0]:
            self._done_with(shard, release=True)
        by_key = {w.key: w for w in self.plan.work if w.outputs}
        first = [by_key[k] for k in dict.fromkeys(self.order) if k in by_key]
        taken = {w.key for w in first}
        for w in first:
            yield w, shards[w.src_file]
        for name in self.plan.input_files:
            rest = [w for w in by_file.get(name, []) if w.outputs and w.key not in taken]
            for w in sorted(rest, key=lambda w: shards[name].header[w.key].begin):
                yield w, shards[name]
