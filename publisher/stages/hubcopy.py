"""--low-disk with a push: the files the run does not change go from the base repo to the target, never to disk.

Text encoders, VAE, tokenizers, scheduler and licence files are the same bytes in the target as in the base. For
each of them the base's metadata (at the pinned sha) gives the size and the sha256 (LFS) or git blob id before a
byte moves:

- an **LFS file** is read over HTTP (``HubFile``, which checks every byte it hands out against the base's sha256
  whatever order they are read in, and stops before the last bytes of a file whose hash is wrong). Through Xet (the
  Hub's default) the bytes stream into hf_xet (``xetupload``), which hashes what it chunks; that digest must be the
  base's oid before the file joins the commit. With Xet off, huggingface_hub's LFS pre-upload reads the same
  ``HubFile`` (in parts when the Hub asks for multipart); its LFS batch skips an object the target already holds;
- a **small (regular) file** is read into memory, checked against its git blob id, and committed with the rest.

``HubCopy`` does this on a thread of its own while the quantization runs, so its network traffic overlaps the
compute. The base hashes are the plan's (``plan.base_hashes``, from the Hub's metadata at plan time).
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from publisher.errors import SourceError
from publisher.handoffs.plan import Plan
from publisher.io import hub, xetupload
from publisher.streaming.shards import RangeFile
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
    """A base file as an upload source, read over HTTP, every byte it hands out vouched for whatever order the
    uploader reads in: sequential (a single PUT, a Xet stream), part by part after seeking to the end and back
    (huggingface_hub's multipart ``SliceFileObj``), a part sent again after a failed try, or parts in parallel.

    Bytes are fetched in aligned ``BLOCK``s (one ``Range`` request per run of sequential blocks). The first time a
    block comes in file order it extends the file's running sha256, and the hash states before and after it are kept
    (a sha256 state is a few hundred bytes); a block fetched again is hashed from its kept starting state and must end
    in the same state, so a retried part cannot bring other bytes; a read ahead of the hash first fetches and hashes
    the blocks before it. The read that completes the file's hash raises ``HashMismatch`` instead of returning its
    bytes when the sha256 is not the base's oid, and so does every read after it: the upload never completes."""

    BLOCK = 1 << 20

    def __init__(self, url: str, token: str | None, size: int, sha256: str, name: str) -> None:
        self.url, self.token, self.size, self.sha256, self.name = url, token, size, sha256, name
        self.pos = 0
        self.transferred = 0  # bytes fetched (re-reads included): 0 when the target already held the object
        self.failure: HashMismatch | None = None
        self._digest = hashlib.sha256()
        self._before: list[Any] = []  # block k -> the hash state before it (a copy)
        self._after: list[str] = []  # block k -> the digest of the state after it
        self._lock = threading.Lock()  # parallel parts read through one object
        self._stream: Any = None
        self._chunks: Any = None
        self._next = -1  # the block the open stream delivers next
        self._pending = b""
        self._block = (-1, b"")  # the last block handed out from

    @property
    def hashed(self) -> int:
        """Bytes [0, hashed) went through the file's hash in order."""
        return min(len(self._after) * self.BLOCK, self.size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.size + pos}[whence]
        return self.pos

    def readinto(self, view: Any) -> int:
        want = min(len(view), self.size - self.pos)
        if want <= 0:
            return 0
        with self._lock:
            index = self.pos // self.BLOCK
            data = self._block[1] if self._block[0] == index else self._verified(index)
            self._block = (index, data)
        start = self.pos - index * self.BLOCK
        n = min(want, len(data) - start)
        memoryview(view).cast("B")[:n] = data[start:start + n]
        self.pos += n
        return n

    def _verified(self, index: int) -> bytes:
        """Block ``index``, fetched and checked (the blocks before it are hashed first when the hash is behind)."""
        if self.failure is not None:
            raise self.failure
        while len(self._after) < index:
            self._absorb(len(self._after), self._fetch(len(self._after)))
        data = self._fetch(index)
        if index == len(self._after):
            self._absorb(index, data)
        else:
            again = self._before[index].copy()
            again.update(data)
            if again.hexdigest() != self._after[index]:
                self.failure = HashMismatch(f"{self.name}: bytes {index * self.BLOCK}-{index * self.BLOCK + len(data) - 1}"
                                            " differ from the first read of them; the upload was stopped")
                raise self.failure
        return data

    def _absorb(self, index: int, data: bytes) -> None:
        self._before.append(self._digest.copy())
        self._digest.update(data)
        self._after.append(self._digest.copy().hexdigest())
        if self.hashed == self.size and self._digest.hexdigest() != self.sha256:
            self.failure = HashMismatch(f"{self.name}: the bytes read from the base have sha256 {self._digest.hexdigest()}, "
                                        f"its metadata says {self.sha256}; the upload was stopped before its last bytes")
            raise self.failure

    def _fetch(self, index: int) -> bytes:
        """One whole block from the network: from the open stream when it is there, else a new ``Range`` request."""
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

        start = index * self.BLOCK
        length = min(self.BLOCK, self.size - start)
        if self._next != index:
            self._close_stream()
            headers = {**build_hf_headers(token=self.token or None), "Range": f"bytes={start}-{self.size - 1}"}
            self._stream = http_stream_backoff("GET", self.url, headers=headers)
            response = self._stream.__enter__()
            hf_raise_for_status(response)
            if response.status_code != 206 and start:
                raise OSError(f"{self.name}: the server ignored the byte range (HTTP {response.status_code})")
            self._chunks = response.iter_bytes()  # as they come off the socket (see RangeFile)
        parts, got = [self._pending] if self._pending else [], len(self._pending)
        while got < length:
            try:
                chunk = next(self._chunks)
            except StopIteration:
                raise OSError(f"{self.name}: the base file ended at byte {start + got} of {self.size}") from None
            self.transferred += len(chunk)
            parts.append(chunk)
            got += len(chunk)
        data = b"".join(parts)
        self._pending, self._next = data[length:], index + 1
        return data[:length]

    def _close_stream(self) -> None:
        self._pending, self._next = b"", -1
        if self._stream is not None:
            try:
                self._stream.__exit__(None, None, None)
            finally:
                self._stream = self._chunks = None

    def chunks(self) -> Iterator[bytes]:
        """The whole file in order, block by block, each checked as above (a Xet stream upload's source)."""
        self.seek(0)
        for index in range((self.size + self.BLOCK - 1) // self.BLOCK):
            with self._lock:
                data = self._verified(index)
            yield data
            self.pos = index * self.BLOCK + len(data)

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
        self._after: HubCopy | None = None
        self._thread = threading.Thread(target=self._run, name="hf-ao-publish-hubcopy", daemon=True)

    def start(self, after: HubCopy | None = None) -> HubCopy:
        """``after``: another recipe's copy of the same files, waited for first, so that the target Hub holds their
        objects by then and skips their transfer (several recipes' copies at once would each move every byte)."""
        self._after = after
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
        after = self._after
        while after is not None and after._thread.is_alive() and not self._stop.is_set():
            after._thread.join(0.2)  # its error is its own recipe's; this copy goes on either way
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


        data = RangeFile(self._url(path), self.token, f"{self.plan.source.display}/{path}").read(want.size)
        if len(data) != want.size or git_blob_id(data) != want.git_oid:
            raise HashMismatch(f"{self.plan.source.display}/{path}: the bytes read do not match the git blob id "
                               f"{want.git_oid} of the base; nothing was copied")
        self.ops.append(CommitOperationAdd(path_in_repo=path, path_or_fileobj=data))
        self.expected[path] = CommitFile(want.size, hashlib.sha256(data).hexdigest(), want.git_oid)
        self.copied.append(Copied(path, want.size, want.size, False))

    def _lfs(self, path: str, want: CommitFile) -> None:
        assert want.sha256 is not None
        name = f"{self.plan.source.display}/{path}"
        sample = RangeFile(self._url(path), self.token, name).read(min(512, want.size))  # the pre-upload's sniff
        source = HubFile(self._url(path), self.token, want.size, want.sha256, name)
        try:
            op = self._through_xet(path, want, sample, source) if xetupload.enabled() else \
                self._through_lfs(path, want, sample, source)
        finally:
            source.close()
        self.ops.append(op)
        small = op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes) and op.path_or_fileobj else None
        self.expected[path] = CommitFile(want.size, want.sha256, git_blob_id(small) if small is not None else None)
        self.copied.append(Copied(path, want.size, source.transferred, True))
        log.info("%s (%.1f MB): %s", path, want.size / 1e6, "streamed from the base to the target, sha256 checked"
                 if source.transferred else "the target Hub already holds this object: not transferred")

    def _through_xet(self, path: str, want: CommitFile, sample: bytes, source: HubFile) -> Any:
        """The Hub's default path: the checked bytes are streamed into hf_xet, which hashes what it chunks; the commit
        names that digest, and only after it matched the base's oid (the reader has checked it too)."""
        assert want.sha256 is not None
        what = f"copying {path} from {self.plan.source.display} to {self.target}"
        done = hub.call(self._stream_once, path, source, what=what)
        if done.sha256 != want.sha256 or done.size != want.size:
            raise HashMismatch(f"{source.name}: hf_xet hashed the {done.size} bytes it uploaded to sha256 {done.sha256}, "
                               f"the base's oid is {want.sha256} ({want.size} bytes); nothing was committed")
        return xetupload.uploaded_operation(path, want.size, want.sha256, sample)

    def _stream_once(self, path: str, source: HubFile) -> xetupload.Uploaded:
        def checked() -> Iterator[bytes]:
            for block in source.chunks():
                if self._stop.is_set():
                    raise RuntimeError("the copy was cancelled")
                yield block

        try:
            return xetupload.upload_stream(self.target, checked(), token=self.token, name=path)
        except RuntimeError as exc:  # hf_xet wraps what the source raised
            if source.failure is not None:
                raise source.failure from None
            raise OSError(f"uploading {path} to {self.target} through Xet failed: {exc}") from exc

    def _through_lfs(self, path: str, want: CommitFile, sample: bytes, source: HubFile) -> Any:
        """With Xet off (HF_HUB_DISABLE_XET=1): huggingface_hub's LFS upload reads the file object (in parts when
        the Hub asks for multipart); its LFS batch skips an object the target Hub already holds."""
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.lfs import UploadInfo


        assert want.sha256 is not None
        op = CommitOperationAdd(path_in_repo=path, path_or_fileobj=b"")  # reads nothing: the source is set below
        op.path_or_fileobj = io.BufferedReader(source, buffer_size=HubFile.BLOCK)
        op.upload_info = UploadInfo(size=want.size, sample=sample, sha256=bytes.fromhex(want.sha256))
        api = hub.client(self.token)
        try:
            hub.call(api.preupload_lfs_files, self.target, additions=[op], free_memory=False,
                     what=f"copying {path} from {self.plan.source.display} to {self.target}")
        except Exception:
            if source.failure is not None:  # huggingface_hub wraps (or retries past) what the source raised
                raise source.failure from None
            raise
        if source.failure is not None:
            raise source.failure
        if op._upload_mode == "lfs":
            return op
        # the target takes it as a small regular file: commit it from memory
        data = RangeFile(self._url(path), self.token, source.name).read(want.size)
        if hashlib.sha256(data).hexdigest() != want.sha256:
            raise HashMismatch(f"{source.name}: the bytes read from the base do not hash to its oid {want.sha256}")
        return CommitOperationAdd(path_in_repo=path, path_or_fileobj=data)
