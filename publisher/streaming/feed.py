"""The engine's input side: which checkpoint tensor comes next, read one tensor ahead on a thread of its own.

Two orders:

- **file order** (the default): input shards one at a time in name order, each tensor by its offset (sequential
  reads); a shard is fetched when its first tensor is due and released as soon as its last one is read, so a
  caller that downloads shards holds one of them at a time.
- **a given order** (``order``: checkpoint keys, e.g. the order a forward pass uses them): every shard is opened
  at the start (by HTTP range, or local files) and the listed keys come first, the rest after them in file order.
  Over HTTP range every tensor is one request anyway, so the order costs no extra bytes.

The reader thread reads tensor k+1 while the engine quantizes tensor k (file reads and HTTP transfers release the
GIL), and never more than one tensor ahead: the engine holds at most two input tensors at once. A pass-through
tensor larger than ``CHUNK_BYTES`` that nobody needs whole (e.g. a big embedding) arrives in chunks instead.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from publisher.errors import QuantizeError
from publisher.localfiles import open_regular
from publisher.streaming import safetensors_io as stio
from publisher.streaming.layout import Plan, Work


@dataclass
class Item:
    """One tensor (or one chunk of a large pass-through tensor) read from the checkpoint."""

    work: Work
    entry: stio.HeaderEntry
    raw: Any  # the tensor as stored; for a chunk, its raw bytes (uint8)
    chunk_at: int = -1  # byte offset of a chunk inside the tensor; -1: the whole tensor
    last: bool = True  # the last chunk of its tensor


@dataclass
class _Shard:
    name: str
    src: Any  # what fetch_shard returned (a path, or an open remote file)
    handle: BinaryIO
    header: dict[str, stio.HeaderEntry]
    left: int  # items still to read from it


class Feed:
    """Iterate over ``Item``s in the planned order; ``close()`` stops the reader (always call it)."""

    def __init__(self, plan: Plan, fetch_shard: Callable[[str], Any], release_shard: Callable[[Any], None], *,
                 order: list[str] | None = None, whole: Callable[[str], bool] = lambda key: False,
                 seconds: dict[str, float] | None = None) -> None:
        self.plan, self.fetch, self.release, self.order, self.whole = plan, fetch_shard, release_shard, order, whole
        self.seconds = seconds if seconds is not None else {}
        self.seconds.setdefault("read", 0.0)
        self._q: queue.Queue[Item | BaseException | None] = queue.Queue(maxsize=1)
        self._ahead = threading.Semaphore(1)  # one tensor read ahead of the one the engine works on
        self._stop = threading.Event()
        self._open: dict[str, _Shard] = {}
        self._thread = threading.Thread(target=self._run, name="hf-ao-publish-reader", daemon=True)
        self._thread.start()

    # ---- consumer side (the engine's thread)
    def __iter__(self) -> Iterator[Item]:
        while True:
            got = self._q.get()
            self._ahead.release()
            if got is None:
                return
            if isinstance(got, BaseException):
                raise got
            yield got

    def close(self) -> None:
        self._stop.set()
        self._ahead.release()
        while self._thread.is_alive():
            try:
                self._q.get(timeout=0.05)
                self._ahead.release()
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
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _wait_turn(self) -> bool:
        while not self._ahead.acquire(timeout=0.1):
            if self._stop.is_set():
                return False
        return not self._stop.is_set()

    def _read(self, work: Work, shard: _Shard) -> None:
        entry = shard.header[work.key]
        size = entry.end - entry.begin
        if work.kind == "pass" and size > stio.CHUNK_BYTES and not self.whole(work.key):
            step = stio.chunk_step(entry)
            for at in range(0, size, step):
                if not self._wait_turn():
                    return
                t0 = time.perf_counter()
                raw = stio.read_bytes(shard.handle, entry.begin + at, min(step, size - at))
                self.seconds["read"] += time.perf_counter() - t0
                self._put(Item(work, entry, raw, at, at + step >= size))
            return
        if not self._wait_turn():
            return
        t0 = time.perf_counter()
        raw = stio.read_tensor(shard.handle, entry)
        self.seconds["read"] += time.perf_counter() - t0
        self._put(Item(work, entry, raw))

    def _shard(self, name: str, items: list[Work]) -> _Shard:
        src = self.fetch(name)
        local = isinstance(src, (str, Path))
        handle = open_regular(Path(src)) if local else src  # never blocks on a FIFO; closed in _done_with
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
                self.release(shard.src)
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
