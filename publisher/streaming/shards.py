"""Where safetensors shards are read from, one tensor at a time: a local folder, or a Hub repo by HTTP range.

Range reads are what keep the disk bound of ``--low-disk``: a quantized component's input shards
are never written to disk, each tensor is fetched (``Range: bytes=...``, through huggingface_hub's
HTTP session) when the engine needs it. The same sources serve the streaming verification,
which also reads the published repo back this way.

``CheckpointIndex`` joins every shard's header into one table: the state-dict name of every tensor
(a torchao tensor is saved as several flattened parts plus JSON metadata), so one tensor can be
rebuilt, checked and freed without loading the rest.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from publisher.errors import InputError, SourceError
from publisher.io import hub
from publisher.io.integrity import ForwardReader
from publisher.io.jsonfile import read_object
from publisher.io.localfiles import open_regular
from publisher.streaming import safetensors_io as stio

log = logging.getLogger(__name__)


class LocalShards:
    """A component folder on local disk; ``files``: only these shards (others may still be being written)."""

    def __init__(self, folder: Path, files: list[str] | None = None) -> None:
        self.folder = Path(folder)
        self.where = str(self.folder)
        self._files = files

    def files(self) -> list[str]:
        if self._files is not None:
            return sorted(self._files)
        return sorted(p.name for p in self.folder.glob("*.safetensors"))

    def open(self, name: str) -> BinaryIO:
        return open_regular(self.folder / name)  # unbuffered; never blocks on a FIFO; the caller closes it

    def json(self, name: str) -> dict[str, Any] | None:
        """A JSON file of the folder, through the one JSON reader (size limit, UTF-8, an object); None if absent."""

        path = self.folder / name
        return read_object(path) if path.exists() else None


class HubShards:
    """A component folder of a Hub repo at a fixed revision, read by HTTP range (nothing on disk)."""

    def __init__(self, repo_id: str, revision: str | None, subfolder: str = "", token: str | None = None,
                 listing: list[str] | None = None) -> None:
        self.repo_id, self.revision, self.subfolder, self.token = repo_id, revision, subfolder.strip("/"), token
        self.where = f"{repo_id}@{(revision or 'main')[:12]}" + (f"/{self.subfolder}" if self.subfolder else "")
        self._listing = listing

    def files(self) -> list[str]:
        if self._listing is None:
            api = hub.client(self.token)
            every = hub.call(api.list_repo_files, self.repo_id, revision=self.revision, what=f"listing {self.repo_id}")
            prefix = f"{self.subfolder}/" if self.subfolder else ""
            self._listing = [f[len(prefix):] for f in every if f.startswith(prefix) and "/" not in f[len(prefix):]]
        return sorted(n for n in self._listing if n.endswith(".safetensors"))

    def open(self, name: str) -> BinaryIO:
        from huggingface_hub import hf_hub_url

        url = hf_hub_url(self.repo_id, name, subfolder=self.subfolder or None, revision=self.revision)
        return RangeFile(url, self.token, f"{self.where}/{name}")  # type: ignore[return-value]

    def release(self, shard: object) -> None:
        """The engine read all it needed of ``shard`` (streaming.job.ShardInputs); it closes the file itself."""

    def json(self, name: str) -> dict[str, Any] | None:
        """A JSON file of the folder, through the one JSON reader (size limit, UTF-8, an object); None if absent."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError


        try:
            path = hf_hub_download(self.repo_id, name, subfolder=self.subfolder or None, revision=self.revision,
                                   token=self.token or None)
        except EntryNotFoundError:
            return None
        return read_object(Path(path), f"{self.where}/{name}")


class RangeFile(ForwardReader):
    """A read-only remote file: every ``readinto`` is one ``Range`` GET streamed straight into the caller's
    buffer (huggingface_hub's session, auth headers and retries), so a tensor is held once, in that buffer.
    fsspec's HfFileSystem would buffer each range two or three times over.

    A short answer or a connection dropped mid-body is resumed from the first missing byte (HF_AO_PUBLISH_RETRIES
    tries without progress, with publisher.io.hub's backoff); a server that ignores ``Range`` (200 with the whole file)
    or answers another range is refused with RangeIgnored, never read at the wrong offset."""

    def __init__(self, url: str, token: str | None, name: str) -> None:
        self.url, self.token, self.name = url, token, name
        self.pos = 0
        self.size: int | None = None  # the file's total size, learnt from the first answer (Content-Range)

    def readinto(self, view: Any) -> int:
        """Fill ``view`` from the current position (fewer bytes only at the end of the file)."""
        import time


        view = memoryview(view).cast("B")
        tries, delay = hub.settings()
        done, failures = 0, 0
        while done < len(view):
            got = [0]
            try:
                self._get(view[done:], self.pos + done, got)
            except Exception as exc:
                done += got[0]
                failures = 0 if got[0] else failures + 1
                if not hub.is_transient(exc) or failures >= tries:
                    raise
                wait = min(hub.MAX_DELAY_S, delay * (2 ** max(failures - 1, 0)))
                log.info("reading %s by HTTP range failed (%s); resuming at byte %d in %.1f s", self.name, hub.short(exc),
                         self.pos + done, wait)
                time.sleep(wait)
                continue
            if got[0] == 0:
                break  # the end of the file
            done += got[0]  # a short answer: ask for the rest
        self.pos += done
        return done

    def _get(self, view: memoryview, start: int, got: list[int]) -> None:
        """One Range GET of len(view) bytes at ``start`` into ``view``; ``got[0]`` counts what arrived, even on error."""
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

        want = len(view)
        headers = {**build_hf_headers(token=self.token or None), "Range": f"bytes={start}-{start + want - 1}"}
        # retry_on_exceptions=(): an error while reading the body would be thrown into http_stream_backoff's generator,
        # which then retries inside a `with` ("generator didn't stop after throw()"); readinto resumes instead.
        with http_stream_backoff("GET", self.url, headers=headers, retry_on_exceptions=()) as r:
            self._learn_size(r.status_code, r.headers)
            if r.status_code == 416:
                return  # asked past the end: nothing more to read
            hf_raise_for_status(r)
            given = r.headers.get("Content-Range", "")
            if r.status_code == 206 and not given.startswith(f"bytes {start}-"):
                raise RangeIgnored(f"{self.name}: asked the Hub for bytes {start}-{start + want - 1}, got {given or 'no Content-Range'}; "
                                   "--low-disk needs byte ranges: re-run with --no-low-disk, or use a Hub or proxy that honours Range")
            if r.status_code != 206 and start:
                raise RangeIgnored(f"{self.name}: the server ignored the HTTP Range header (HTTP {r.status_code} with the "
                                   "whole file), so the weights cannot be read tensor by tensor; re-run with --no-low-disk, "
                                   "or use a Hub or proxy that honours Range")
            # Chunks as they come off the socket: iter_bytes(size) would re-chunk them through a BytesIO (two more
            # copies of every byte, under the GIL; measured: a quarter of the reader thread's time in a publish).
            for chunk in r.iter_bytes():  # a 200 at offset 0 is the file's start: read only what was asked
                n = min(len(chunk), want - got[0])
                view[got[0]:got[0] + n] = memoryview(chunk)[:n]
                got[0] += n
                if got[0] == want:
                    break

    def _learn_size(self, status: int, headers: Any) -> None:
        total = (headers.get("Content-Range") or "").rpartition("/")[2]
        if total.isdigit():
            self.size = int(total)
        elif status == 200 and str(headers.get("Content-Length") or "").isdigit():  # the whole file was sent
            self.size = int(headers["Content-Length"])

    def close(self) -> None:
        pass

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RangeIgnored(OSError, SourceError):
    """The server did not answer the byte range asked for: reading on would use bytes from the wrong offset.
    An OSError for the readers' error handling, and a SourceError so that wherever it surfaces (the plan-time
    header checks read by range too) it is one `Error:` line."""


ShardSource = LocalShards | HubShards  # where a component's safetensors files are read from


@dataclass
class CheckpointIndex:
    """Every tensor of a (possibly sharded, possibly torchao-flattened) safetensors checkpoint."""

    entries: dict[str, tuple[str, stio.HeaderEntry]]  # flattened key -> (file, header entry)
    metadata: dict[str, str] = field(default_factory=dict)  # torchao: state-dict name -> JSON
    parts: dict[str, list[str]] = field(default_factory=dict)  # state-dict name -> flattened keys

    @property
    def names(self) -> list[str]:
        """State-dict names in file order (sequential reads)."""
        def first(name: str) -> tuple[str, int]:
            file, entry = self.entries[self.parts[name][0]]
            return file, entry.begin

        return sorted(self.parts, key=first)

    def nbytes(self, name: str) -> int:
        return sum(self.entries[k][1].end - self.entries[k][1].begin for k in self.parts[name])


def build_index(source: ShardSource) -> CheckpointIndex:
    """Read every shard's header (a few KB each) and group the flattened keys by state-dict name."""
    entries: dict[str, tuple[str, stio.HeaderEntry]] = {}
    metadata: dict[str, str] = {}
    names: list[str] = []
    files = source.files()
    if not files:
        raise FileNotFoundError(f"no safetensors files in {source.where}")
    for file in files:
        with source.open(file) as fh:
            meta, header = stio.read_header(fh, f"{source.where}/{file}")
        names.extend(_tensor_names(meta.pop("tensor_names", "[]"), f"{source.where}/{file}"))
        metadata.update({k: v for k, v in meta.items() if k != "format"})
        for key, entry in header.items():
            if key in entries:
                raise ValueError(f"tensor {key} appears in both {entries[key][0]} and {file}")
            entries[key] = (file, entry)
    parts: dict[str, list[str]] = {}
    names = list(dict.fromkeys(names))  # every shard of a sharded checkpoint lists every name
    if names:
        by_module: dict[str, list[tuple[str, str]]] = {}
        for name in names:
            module, attr = name.rsplit(".", 1) if "." in name else ("", name)
            by_module.setdefault(module, []).append((f"_{attr}_", name))
        for key in entries:
            if key in metadata or key in names:  # a plain tensor is saved under its own name
                parts.setdefault(key, []).append(key)
                continue
            module, last = key.rsplit(".", 1) if "." in key else ("", key)
            owner = next((n for p, n in by_module.get(module, []) if last.startswith(p)), key)
            parts.setdefault(owner, []).append(key)
    else:
        parts = {k: [k] for k in entries}
    return CheckpointIndex(entries, metadata, parts)


def _tensor_names(text: str, where: str) -> list[str]:
    """torchao's ``tensor_names`` metadata: a JSON list of state-dict names."""
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InputError(f"{where}: the tensor_names metadata is not a JSON list of names; fix or re-upload the file",
                         kind="metadata")
    return names


class TensorReader:
    """Rebuilds one state-dict tensor at a time from its parts, with plain reads (files kept open)."""

    def __init__(self, source: ShardSource, index: CheckpointIndex) -> None:
        self.source, self.index = source, index
        self._open: dict[str, BinaryIO] = {}

    def _handle(self, file: str) -> BinaryIO:
        if file not in self._open:
            self._open[file] = self.source.open(file)
        return self._open[file]

    def read(self, name: str) -> Any:
        """The tensor saved under ``name``: a torchao tensor subclass when its metadata says so."""
        keys = self.index.parts.get(name)
        if not keys:
            raise KeyError(name)
        data = {}
        for key in keys:
            file, entry = self.index.entries[key]
            data[key] = stio.read_tensor(self._handle(file), entry)
        meta = self.index.metadata.get(name)
        if meta is None or json.loads(meta).get("_type") in ("Tensor", None):
            if len(data) != 1 or name not in data:
                raise ValueError(f"{name} has parts {sorted(data)} but no torchao metadata")
            return data[name]
        from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

        rebuilt, leftover = unflatten_tensor_state_dict(data, {name: meta, "tensor_names": json.dumps([name])})
        if name not in rebuilt or leftover:
            raise ValueError(f"{name}: torchao could not rebuild it from {sorted(data)} ({self.source.where})")
        return rebuilt[name]

    def plain_rows(self, name: str) -> int | None:
        """The number of rows of ``name`` when it is a plain tensor of two or more dimensions (rows can then be read
        alone: ``read_rows``), else None (a torchao tensor, a vector)."""
        meta = self.index.metadata.get(name)
        if self.index.parts.get(name) != [name] or (meta is not None and json.loads(meta).get("_type") not in ("Tensor", None)):
            return None
        entry = self.index.entries[name][1]
        return entry.shape[0] if len(entry.shape) >= 2 else None

    def read_rows(self, name: str, start: int, stop: int) -> Any:
        """Rows ``start:stop`` of the plain tensor ``name`` (``plain_rows``), one range read."""
        file, entry = self.index.entries[name]
        return stio.read_rows(self._handle(file), entry, start, stop)

    def close(self) -> None:
        for fh in self._open.values():
            fh.close()
        self._open.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
