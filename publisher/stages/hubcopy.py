"""--low-disk with a push: the files the run does not change go from the base repo to the target, never to disk.

Text encoders, VAE, tokenizers, scheduler and licence files are the same bytes in the target as in the base. For
each of them the base's metadata (at the pinned sha) gives the size and the sha256 (LFS) or git blob id before a
byte moves:

- an **LFS file** becomes a commit operation whose upload source is the base file itself, read over HTTP in
  chunks (``HubFile``); huggingface_hub's own pre-upload then asks the target's LFS batch endpoint, which answers
  without an upload action when that Hub already holds the object (same Hub, same oid: nothing is transferred),
  and otherwise the bytes stream from the base to the target with their sha256 checked on the way (a mismatch
  aborts the upload before its last chunk, so the target never receives a wrong object);
- a **small (regular) file** is read into memory, checked against its git blob id, and committed with the rest.

``HubCopy`` does this on a thread of its own while the quantization runs, so its network traffic overlaps the
compute. The base hashes are the plan's (``plan.base_hashes``, from the Hub's metadata at plan time).
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
from dataclasses import dataclass
from typing import Any

from publisher import hub
from publisher.errors import SourceError
from publisher.stages.plan import Plan
from publisher.verify.commit_hashes import CommitFile, git_blob_id

log = logging.getLogger(__name__)


def unchanged_files(plan: Plan) -> list[str]:
    """Base files outside every quantized component's folder (the base card excepted: ours replaces it)."""
    folders = [c.name for c in plan.quantized]
    if "" in folders:  # a transformers model is quantized whole: its folder is the repo
        return []
    return [f for f in plan.base_files if f != "README.md" and not any(f.startswith(f"{name}/") for name in folders)]


def base_hashes(plan: Plan, paths: list[str]) -> dict[str, CommitFile]:
    """Size and LFS sha256 or git blob id of ``paths`` in the base at its pinned sha: what the plan read from the
    Hub's metadata (``plan.base_hashes``), which every other read of the base is checked against too."""
    known = plan.base_hashes
    missing = [p for p in paths if p not in known]
    if missing:
        raise SourceError(f"{plan.source.display} lists no hash for {missing[0]}; start the run again")
    return {p: CommitFile(known[p].size, known[p].digest if known[p].algo == "sha256" else None,
                          known[p].digest if known[p].algo == "git-sha1" else None) for p in paths}


class HashMismatch(SourceError):
    """The bytes read from the base do not hash to the oid its metadata announced."""


class HubFile(io.RawIOBase):
    """A base file as an upload source: reads stream it over HTTP (one ``Range`` request per run of sequential
    reads; ``seek`` goes anywhere, as a retried upload does). The bytes of a run that starts at 0 are hashed as
    they pass, and the last read raises ``HashMismatch`` instead of returning the final bytes when their sha256
    is not the expected oid, so the upload never completes with wrong bytes."""

    CHUNK = 1 << 20

    def __init__(self, url: str, token: str | None, size: int, sha256: str, name: str) -> None:
        self.url, self.token, self.size, self.sha256, self.name = url, token, size, sha256, name
        self.pos = 0
        self.digest: Any = None  # the sha256 of the run that started at byte 0, while it runs in order
        self.transferred = 0  # bytes fetched (retries included): 0 when the target already held the object
        self._stream: Any = None
        self._chunks: Any = None
        self._buffer: memoryview | bytes = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        target = {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence]
        if target != self.pos:
            self._close_stream()
            self.digest = None  # out of order: only a run from byte 0 is checked
            self.pos = target
        return self.pos

    def readinto(self, view: Any) -> int:
        want = min(len(view), self.size - self.pos)
        if want <= 0:
            return 0
        if self.pos == 0:
            self.digest = hashlib.sha256()
        if not self._buffer:
            self._buffer = memoryview(self._next_chunk())
        data, self._buffer = self._buffer[:want], self._buffer[want:]  # views: no copy of the rest of the chunk
        if self.digest is not None:
            self.digest.update(data)
            if self.pos + len(data) == self.size and self.digest.hexdigest() != self.sha256:
                got, self.digest = self.digest.hexdigest(), None
                raise HashMismatch(f"{self.name}: the bytes read from the base have sha256 {got}, its metadata "
                                   f"says {self.sha256}; the upload was stopped before its last bytes")
        memoryview(view).cast("B")[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def _next_chunk(self) -> bytes:
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

        if self._chunks is None:
            headers = {**build_hf_headers(token=self.token or None), "Range": f"bytes={self.pos}-{self.size - 1}"}
            self._stream = http_stream_backoff("GET", self.url, headers=headers)
            response = self._stream.__enter__()
            hf_raise_for_status(response)
            if response.status_code != 206 and self.pos:
                raise OSError(f"{self.name}: the server ignored the byte range (HTTP {response.status_code})")
            self._chunks = response.iter_bytes()  # as they come off the socket: no re-chunking copies (see RangeFile)
        try:
            chunk = next(self._chunks)
        except StopIteration:
            raise OSError(f"{self.name}: the base file ended at byte {self.pos} of {self.size}") from None
        self.transferred += len(chunk)
        return chunk

    def _close_stream(self) -> None:
        self._buffer = b""
        if self._stream is not None:
            try:
                self._stream.__exit__(None, None, None)
            finally:
                self._stream = self._chunks = None

    def close(self) -> None:
        self._close_stream()
        super().close()


@dataclass
class Copied:
    path: str
    size: int
    transferred: int  # bytes read from the base (0: the target Hub already held the object)
    lfs: bool


class HubCopy:
    """Copy ``files`` (with their base hashes) from the base repo to ``target`` on a background thread."""

    def __init__(self, plan: Plan, target: str, token: str | None, files: dict[str, CommitFile]) -> None:
        self.plan, self.target, self.token, self.files = plan, target, token, files
        self.ops: list[Any] = []  # commit operations, pre-uploaded where LFS
        self.expected: dict[str, CommitFile] = {}
        self.copied: list[Copied] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf-ao-publish-hubcopy", daemon=True)

    def start(self) -> HubCopy:
        self._thread.start()
        return self

    def wait(self) -> list[Any]:
        """Block until every file is on the target (or raise the copy's error); the commit operations."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.ops

    def cancel(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            for path, want in sorted(self.files.items(), key=lambda kv: kv[1].size):  # small files first
                if self._stop.is_set():
                    return
                if want.sha256 is not None:
                    self._lfs(path, want)
                else:
                    self._regular(path, want)
        except BaseException as exc:  # raised again by wait() in the job's thread
            self.error = exc

    def _url(self, path: str) -> str:
        from huggingface_hub import hf_hub_url

        src = self.plan.source
        return hf_hub_url(src.repo_id, path, revision=src.sha)  # type: ignore[arg-type]

    def _regular(self, path: str, want: CommitFile) -> None:
        from huggingface_hub import CommitOperationAdd

        from publisher.streaming.shards import RangeFile

        data = RangeFile(self._url(path), self.token, f"{self.plan.source.display}/{path}").read(want.size)
        if len(data) != want.size or git_blob_id(data) != want.git_oid:
            raise HashMismatch(f"{self.plan.source.display}/{path}: the bytes read do not match the git blob id "
                               f"{want.git_oid} of the base; nothing was copied")
        self.ops.append(CommitOperationAdd(path_in_repo=path, path_or_fileobj=data))
        self.expected[path] = CommitFile(want.size, hashlib.sha256(data).hexdigest(), want.git_oid)
        self.copied.append(Copied(path, want.size, want.size, False))

    def _lfs(self, path: str, want: CommitFile) -> None:
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.lfs import UploadInfo

        from publisher.streaming.shards import RangeFile

        assert want.sha256 is not None
        name = f"{self.plan.source.display}/{path}"
        sample = RangeFile(self._url(path), self.token, name).read(min(512, want.size))  # the pre-upload's sniff
        source = HubFile(self._url(path), self.token, want.size, want.sha256, name)
        op = CommitOperationAdd(path_in_repo=path, path_or_fileobj=b"")  # reads nothing: the source is set below
        op.path_or_fileobj = io.BufferedReader(source, buffer_size=HubFile.CHUNK)
        op.upload_info = UploadInfo(size=want.size, sample=sample, sha256=bytes.fromhex(want.sha256))
        api = hub.client(self.token)
        try:
            try:
                hub.call(api.preupload_lfs_files, self.target, additions=[op], free_memory=False,
                         what=f"copying {path} from {self.plan.source.display} to {self.target}")
            except RuntimeError as exc:  # huggingface_hub wraps what the upload source raised
                if isinstance(exc.__cause__, HashMismatch):
                    raise exc.__cause__ from None
                raise
            if op._upload_mode != "lfs":  # the target takes it as a small regular file: commit it from memory
                data = RangeFile(self._url(path), self.token, name).read(want.size)
                if hashlib.sha256(data).hexdigest() != want.sha256:
                    raise HashMismatch(f"{name}: the bytes read from the base do not hash to its oid {want.sha256}")
                op = CommitOperationAdd(path_in_repo=path, path_or_fileobj=data)
        finally:
            source.close()
        self.ops.append(op)
        small = op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes) else None
        self.expected[path] = CommitFile(want.size, want.sha256, git_blob_id(small) if small is not None else None)
        self.copied.append(Copied(path, want.size, source.transferred, True))
        log.info("%s (%.1f MB): %s", path, want.size / 1e6, "streamed from the base to the target, sha256 checked"
                 if source.transferred else "the target Hub already holds this object: not transferred")
