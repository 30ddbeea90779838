"""Every byte we read from the Hub, checked against the hash the Hub itself reports for its file.

For every file of a commit the Hub reports (``model_info(..., files_metadata=True)``, ``get_paths_info``) the
sha256 of an LFS file's content and the git blob id of a regular file (sha1 of ``b"blob <size>\\0"`` + content).
huggingface_hub checks only a download's size; a byte flipped on the way (the size and ETag still right) is
cached, quantized and published as verified unless someone compares. This module holds the comparison:

    expected = FileHash.from_sibling(sibling)          # at plan time, from the Hub's metadata
    check_file(path, expected, "transformer/x.safetensors of org/name@0123abcd")   # a download, before use
    reader = HashedReader(range_file, expected, label)   # HTTP range reads: one running hash per file...
    reader.finish()                                      # ...compared once the file was read to its end

A mismatch raises IntegrityError naming the file and both hashes. Hashing costs about 0.7 GiB/s per core
(hashlib's sha256 and sha1 measured alike on this project's 2-core machine, 512 MiB of random bytes).
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from publisher.errors import IntegrityError

BLOCK = 1 << 20  # read granularity for hashing and for skipping gaps: never more held than this


@dataclass(frozen=True)
class FileHash:
    """What the Hub says one file's bytes hash to: ``sha256`` (LFS) or ``git-sha1`` (the git blob id)."""

    algo: Literal["sha256", "git-sha1"]
    digest: str
    size: int

    @property
    def kind(self) -> str:
        return "sha256" if self.algo == "sha256" else "git blob id"

    def hasher(self, size: int | None = None) -> Any:
        """A fresh hashlib object; a git blob id covers ``blob <size>\\0`` first (``size``: the actual bytes' length)."""
        if self.algo == "sha256":
            return hashlib.sha256()
        h = hashlib.sha1()  # git's object id, not a security choice: the Hub reports exactly this
        h.update(b"blob %d\0" % (self.size if size is None else size))
        return h

    def to_json(self) -> dict[str, Any]:
        key = "sha256" if self.algo == "sha256" else "git_blob"
        return {key: self.digest, "size": self.size}

    @classmethod
    def from_json(cls, data: Any) -> FileHash | None:
        """The inverse of ``to_json``; None for anything else (a state file written by hand, or by an old version)."""
        if not isinstance(data, dict) or not isinstance(data.get("size"), int):
            return None
        for key, algo in (("sha256", "sha256"), ("git_blob", "git-sha1")):
            if isinstance(data.get(key), str):
                return cls(algo, data[key].lower(), data["size"])  # type: ignore[arg-type]
        return None

    @classmethod
    def from_sibling(cls, sibling: Any) -> FileHash | None:
        """From a huggingface_hub RepoSibling (model_info with files_metadata) or RepoFile (get_paths_info, tree)."""
        size = getattr(sibling, "size", None)
        lfs = getattr(sibling, "lfs", None)
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        if sha is None and isinstance(lfs, dict):
            sha = lfs.get("sha256") or lfs.get("oid")
        if isinstance(sha, str) and isinstance(size, int):
            return cls("sha256", sha.lower(), size)
        blob = getattr(sibling, "blob_id", None)
        if isinstance(blob, str) and isinstance(size, int):
            return cls("git-sha1", blob.lower(), size)
        return None


def hashes_of(siblings: Any) -> dict[str, FileHash]:
    """Path -> FileHash for every file of a model_info(files_metadata=True) answer that carries one."""
    out: dict[str, FileHash] = {}
    for s in siblings or ():
        h = FileHash.from_sibling(s)
        if h is not None:
            out[s.rfilename] = h
    return out


def sha256_file(path: Path) -> str:
    """The sha256 of a local file's bytes, read a block at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def hash_file(path: Path, expected: FileHash) -> str:
    """The digest of a local file with ``expected``'s algorithm (its real size for a git blob id)."""
    h = expected.hasher(path.stat().st_size)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return str(h.hexdigest())


def mismatch(label: str, expected: FileHash, got: str, how: str, after: str) -> IntegrityError:
    """The one error for bytes that are not the Hub's: names the file, both hashes, and says to download again."""
    return IntegrityError(f"{label}: the {how} have {expected.kind} {got}, but the Hub reports {expected.digest}; "
                          f"{after}; download again (re-run the same command)")


def check_file(path: Path, expected: FileHash, label: str, *, how: str = "downloaded bytes",
               after: str = "nothing was published") -> None:
    got = hash_file(path, expected)
    if got != expected.digest:
        raise mismatch(label, expected, got, how, after)


class Readable(Protocol):
    """What HashedReader needs of the file it wraps (a RangeFile, or any binary file)."""

    def seek(self, pos: int, whence: int = 0) -> int: ...

    def readinto(self, view: Any) -> int | None: ...

    def close(self) -> None: ...


class ForwardReader:
    """The read-only file interface the safetensors readers use (seek from the start, tell, read), on top of a
    subclass's ``readinto`` at ``self.pos``: shared by HashedReader and streaming.shards.RangeFile."""

    pos = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0:
            raise ValueError(f"{type(self).__name__} seeks from the start only")
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, view: Any) -> int:
        raise NotImplementedError

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.readinto(memoryview(buf))
        return bytes(buf[:got])


class HashedReader(ForwardReader):
    """A read-only file (a Hub file read by HTTP range) whose bytes are hashed as the caller reads them in file order.

    Forward jumps (padding, tensors nobody reads) are read and hashed on the way, BLOCK bytes at a time, so one
    running hash covers the whole file while the caller holds only what it asked for; ``finish()`` reads what is
    left and compares. A read that goes back over hashed bytes cannot be vouched for, and makes ``finish()`` fail."""

    def __init__(self, inner: Readable, expected: FileHash, label: str) -> None:
        self.inner, self.expected, self.name = inner, expected, label
        self._h = expected.hasher()
        self.pos = 0  # where the caller's next read starts
        self.hashed = 0  # bytes [0, hashed) went through the hash, in order
        self.rewound = False

    @property
    def size(self) -> int | None:
        """The file's total size as the inner reader knows it (a RangeFile learns it from the server): the header
        validator bounds the header by it."""
        size = getattr(self.inner, "size", None)
        return size if isinstance(size, int) else self.expected.size

    def readinto(self, view: Any) -> int:
        view = memoryview(view).cast("B")
        if self.pos > self.hashed:
            self._skip_to(self.pos)
        self.inner.seek(self.pos)
        n = self.inner.readinto(view) or 0
        if self.pos == self.hashed:
            self._h.update(view[:n])
            self.hashed += n
        elif n:
            self.rewound = True  # bytes handed out again after they were hashed: no longer one pass
        self.pos += n
        return n

    def _skip_to(self, target: int) -> None:
        """Read and hash [hashed, target) without handing it out."""
        buf = bytearray(min(BLOCK, max(target - self.hashed, 0)))
        view = memoryview(buf)
        self.inner.seek(self.hashed)
        while self.hashed < target:
            want = min(len(buf), target - self.hashed)
            n = self.inner.readinto(view[:want]) or 0
            if n == 0:
                raise IntegrityError(f"{self.name}: the file ended after {self.hashed} bytes, but the Hub reports "
                                     f"{self.expected.size}; download again (re-run the same command)")
            self._h.update(view[:n])
            self.hashed += n

    def finish(self, after: str = "nothing was published") -> None:
        """Read the rest of the file into the hash and compare it with the Hub's; raises IntegrityError on a mismatch."""
        if self.rewound:
            raise IntegrityError(f"{self.name}: read out of order, so its bytes could not be checked against the Hub's "
                                 f"{self.expected.kind}; {after}; use --no-low-disk")
        self._skip_to(self.expected.size)
        got = self._h.hexdigest()
        if got != self.expected.digest:
            raise mismatch(self.name, self.expected, got, "bytes read by HTTP range", after)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> HashedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SpillingHashedReader(HashedReader):
    """A HashedReader that may be read in any order (a forward pass during quantization wants execution order,
    which is not file order: ``transformer_blocks.10`` is stored before ``transformer_blocks.2``, ``x_embedder``
    last), still fetching each byte from the Hub once and still hashing the whole file in file order.

    Bytes handed out beyond the hash cursor are also written to a spill file of their own in ``spill_dir`` and
    hashed from there (then deleted) once the cursor reaches them; bytes behind the cursor cannot be handed out
    again (``finish()`` fails). The spill holds what was read ahead of the cursor and not yet hashed: for
    FLUX.1-dev's transformer in execution order that peaks at 5.44 GB of a 10 GB shard (computed from the
    layout by benchmarks/spill_layout.py), on disk, never in memory. ``finish()`` fetches the bytes nobody
    asked for (padding, tensors the run does not read) and compares.

    The hashing and spilling run on a thread of their own, in the order the bytes were read, so the caller's next
    network read overlaps them (measured in a publish: the engine spent half the pass waiting for its reader,
    which fetched, hashed and spilled one after the other). That thread keeps a view of the caller's buffer until
    it is hashed or spilled: at most ``PENDING_BYTES`` (or one read) wait for it. Should the caller change a
    buffer before then, the hash no longer matches and ``finish()`` refuses the file: never a silent pass."""

    PENDING_BYTES = 128 << 20

    def __init__(self, inner: Readable, expected: FileHash, label: str, spill_dir: Path) -> None:
        super().__init__(inner, expected, label)
        self.spill_dir = spill_dir
        self.prefix = f"spill-{id(self):x}-"
        self.pending: dict[int, tuple[int, Path]] = {}  # start -> (end, the file holding [start, end))
        self.spilled = 0  # bytes waiting on disk now
        self.peak_spilled = 0
        self._jobs: deque[tuple[int, memoryview]] = deque()  # (offset, bytes) read, not yet hashed or spilled
        self._queued = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closing = False
        self._worker: threading.Thread | None = None  # started by the first read

    def readinto(self, view: Any) -> int:
        view = memoryview(view).cast("B")
        self.inner.seek(self.pos)
        n = self.inner.readinto(view) or 0
        if n:
            self._submit(self.pos, view[:n])
        self.pos += n
        return n

    # ---- the hashing thread
    def _submit(self, start: int, data: memoryview) -> None:
        with self._cv:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="hf-ao-publish-hash", daemon=True)
                self._worker.start()
            while self._queued and self._queued + len(data) > self.PENDING_BYTES and self._error is None:
                self._cv.wait()
            self._raise()
            self._jobs.append((start, data))
            self._queued += len(data)
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closing:
                    self._cv.wait()
                if not self._jobs:
                    return
                start, data = self._jobs[0]
                skip = self._closing or self._error is not None
            try:
                if not skip:
                    self._take(start, data)
            except BaseException as exc:  # handed to the caller by its next read, finish() or close()
                self._error = exc
            with self._cv:
                self._jobs.popleft()
                self._queued -= len(data)
                self._cv.notify_all()
            del data

    def _take(self, start: int, data: memoryview) -> None:
        """(hashing thread) What a read at ``start`` means for the hash: continue it, spill it, or spoil it."""
        end = start + len(data)
        if start < self.hashed:
            self.rewound = True  # handed out again after they were hashed: these bytes are not vouched for
        elif start == self.hashed:
            self._h.update(data)
            self.hashed = end
            self._drain()
        else:
            piece = self.spill_dir / f"{self.prefix}{start}"
            with open(piece, "wb") as fh:
                fh.write(data)
            self.pending[start] = (end, piece)
            self.spilled += len(data)
            self.peak_spilled = max(self.peak_spilled, self.spilled)

    def _raise(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    def settle(self) -> None:
        """Wait until the hashing thread has taken every read; raise what it ran into."""
        with self._cv:
            while self._jobs:
                self._cv.wait()
            self._raise()

    def _drain(self) -> None:
        """Hash (and delete) the spilled pieces that now continue the cursor."""
        while self.hashed in self.pending:
            end, piece = self.pending.pop(self.hashed)
            got = 0
            with open(piece, "rb") as fh:
                while chunk := fh.read(BLOCK):
                    self._h.update(chunk)
                    got += len(chunk)
            piece.unlink()
            if got != end - self.hashed:
                raise IntegrityError(f"{self.name}: the spill file {piece} lost bytes; re-run the same command")
            self.spilled -= end - self.hashed
            self.hashed = end

    def finish(self, after: str = "nothing was published") -> None:
        """Fetch and hash the gaps nobody read, hash what waits in the spill, compare with the Hub's hash."""
        self.settle()
        while self.pending:
            self._skip_to(min(self.pending))
            self._drain()
        super().finish(after)

    def close(self) -> None:
        with self._cv:
            self._closing = True  # what is still queued is dropped: the file is not being checked any more
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join()
        try:
            for _, piece in self.pending.values():
                piece.unlink(missing_ok=True)
            self.pending.clear()
        finally:
            super().close()
