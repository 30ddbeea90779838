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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from publisher.streaming import safetensors_io as stio


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
        return open(self.folder / name, "rb", buffering=0)  # noqa: SIM115 - the caller closes it

    def text(self, name: str) -> str | None:
        path = self.folder / name
        return path.read_text(encoding="utf-8") if path.is_file() else None


class HubShards:
    """A component folder of a Hub repo at a fixed revision, read by HTTP range (nothing on disk)."""

    def __init__(self, repo_id: str, revision: str | None, subfolder: str = "", token: str | None = None,
                 listing: list[str] | None = None) -> None:
        self.repo_id, self.revision, self.subfolder, self.token = repo_id, revision, subfolder.strip("/"), token
        self.where = f"{repo_id}@{(revision or 'main')[:12]}" + (f"/{self.subfolder}" if self.subfolder else "")
        self._listing = listing

    def files(self) -> list[str]:
        if self._listing is None:
            from publisher import hub

            api = hub.client(self.token)
            every = hub.call(api.list_repo_files, self.repo_id, revision=self.revision, what=f"listing {self.repo_id}")
            prefix = f"{self.subfolder}/" if self.subfolder else ""
            self._listing = [f[len(prefix):] for f in every if f.startswith(prefix) and "/" not in f[len(prefix):]]
        return sorted(n for n in self._listing if n.endswith(".safetensors"))

    def open(self, name: str) -> BinaryIO:
        from huggingface_hub import hf_hub_url

        url = hf_hub_url(self.repo_id, name, subfolder=self.subfolder or None, revision=self.revision)
        return RangeFile(url, self.token, f"{self.where}/{name}")  # type: ignore[return-value]

    def text(self, name: str) -> str | None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            path = hf_hub_download(self.repo_id, name, subfolder=self.subfolder or None, revision=self.revision,
                                   token=self.token or None)
        except EntryNotFoundError:
            return None
        return Path(path).read_text(encoding="utf-8")


class RangeFile:
    """A read-only remote file: every ``readinto`` is one ``Range`` GET streamed straight into the caller's
    buffer (huggingface_hub's session, auth headers and retries), so a tensor is held once, in that buffer.
    fsspec's HfFileSystem would buffer each range two or three times over."""

    CHUNK = 1 << 20

    def __init__(self, url: str, token: str | None, name: str) -> None:
        self.url, self.token, self.name = url, token, name
        self.pos = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0:
            raise ValueError("RangeFile seeks from the start only")
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        got = self.readinto(memoryview(buf))
        return bytes(buf[:got])

    def readinto(self, view: Any) -> int:
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

        view = memoryview(view).cast("B")
        want = len(view)
        if want == 0:
            return 0
        headers = {**build_hf_headers(token=self.token or None), "Range": f"bytes={self.pos}-{self.pos + want - 1}"}
        done = 0
        with http_stream_backoff("GET", self.url, headers=headers) as r:
            hf_raise_for_status(r)
            if r.status_code != 206 and self.pos:
                raise OSError(f"{self.name}: the server ignored the byte range (HTTP {r.status_code})")
            for chunk in r.iter_bytes(self.CHUNK):
                n = min(len(chunk), want - done)
                view[done:done + n] = chunk[:n]
                done += n
                if done == want:
                    break
        self.pos += done
        return done

    def close(self) -> None:
        pass

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
            meta, header = stio.read_header(fh)
        names.extend(json.loads(meta.pop("tensor_names", "[]")))
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

    def close(self) -> None:
        for fh in self._open.values():
            fh.close()
        self._open.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
