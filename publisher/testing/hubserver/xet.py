"""Xet storage for the loopback Hub, on hf_xet's own file-based CAS (``local://DIR``), as huggingface.co serves it.

The shape follows one constraint: hf_xet's local CAS keeps a database that one process at a time can open, and a
client holds it open for as long as an upload commit or a download group lives. So no CAS folder is ever used by
two processes at once:

    xet/incoming/<id>/   one per write token: the client's upload lands here; the server reads it only at the commit
    xet/store/           the Hub's own CAS: only this server writes it (under a lock), and only verified bytes
    xet/read/<id>/       one per read token: a snapshot of the store (xorbs and shards hard-linked, its database
                         copied) that the client downloads from
    xet/known/<sha256>   the Xet hash of every file the store holds

At a commit the client names a file by its sha256 only. The server looks it up in the incoming shards by the sha256
the client *claimed* (hf_xet writes it into the shard's metadata extension, and with a preset sha256 it records the
claim without hashing anything), rebuilds the bytes from that CAS with hf_xet and hashes them: a false claim is
refused, so the loopback is as strict on Xet as on LFS. The verified bytes go to the blob store (plain HTTP and range
reads, as the Hub's storage bridge serves them) and into the store, whose Xet hash ``files_metadata``, tree listings
and ``X-Xet-Hash`` report. LFS uploads are moved into the store at their commit too (the Hub migrates them), so every
LFS file of a repo is Xet-backed.

The shard format read here is xet-core's ``metadata_shard`` (``file_structs.rs``): a 48-byte header, then per file a
48-byte header (hash, flags, entry count), its segments, one verification entry per segment when flagged, and one
metadata extension (the sha256) when flagged, up to a bookend of 0xFF bytes. Hashes are four little-endian u64 words.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from publisher.testing.hubserver.storage import HubError

_ENTRY = 48
_WITH_VERIFICATION = 1 << 31
_WITH_METADATA_EXT = 1 << 30
_BOOKEND = b"\xff" * 32
_TAG = b"HFRepoMetaData\x00"
READ_TOKEN_S = 3600  # a read token's lifetime: also how long its snapshot folder is kept


def hash_hex(raw: bytes) -> str:
    """A Xet hash as hf_xet prints it: its four u64 words, each little-endian."""
    return b"".join(raw[i:i + 8][::-1] for i in range(0, 32, 8)).hex()


@dataclass(frozen=True)
class Segment:
    xorb: str  # the xorb's hash (its file name in the CAS is default.<hash>)
    chunks: tuple[int, int]
    size: int


@dataclass(frozen=True)
class ShardFile:
    """One file a shard describes: its Xet hash, the sha256 the uploader claimed (None: none recorded), its segments."""

    xet_hash: str
    claimed_sha256: str | None
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)


def parse_shard(raw: bytes) -> list[ShardFile]:
    """The file section of a shard (``*.mdb``); ValueError when it is not one."""
    if len(raw) < _ENTRY or not raw.startswith(_TAG):
        raise ValueError("not a Xet shard")
    out: list[ShardFile] = []
    off = _ENTRY
    while off + _ENTRY <= len(raw):
        head = raw[off:off + 32]
        if head == _BOOKEND:
            return out
        flags, count = struct.unpack_from("<II", raw, off + 32)
        off += _ENTRY
        segments = []
        for i in range(count):
            at = off + i * _ENTRY
            _, size, start, end = struct.unpack_from("<IIII", raw, at + 32)
            segments.append(Segment(hash_hex(raw[at:at + 32]), (start, end), size))
        off += count * _ENTRY
        if flags & _WITH_VERIFICATION:
            off += count * _ENTRY
        sha = None
        if flags & _WITH_METADATA_EXT:
            sha = hash_hex(raw[off:off + 32])
            off += _ENTRY
        out.append(ShardFile(hash_hex(head), sha, tuple(segments)))
    raise ValueError("truncated Xet shard")


def cas_url(folder: Path) -> str:
    return f"local://{folder}"


def _xorbs(folder: Path) -> Path:
    return folder / "xet" / "xorbs"


class XetStore:
    """The loopback Hub's Xet side: token folders, the commit-time check of Xet uploads, the store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("incoming", "store", "read", "known"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()  # the store folder: one writer, and no snapshot while it writes
        self._seen: dict[Path, list[ShardFile]] = {}  # incoming shard file -> its files (shards are immutable)
        self._session: Any = None

    # ---- token folders -----------------------------------------------------------------------
    def new_incoming(self) -> Path:
        folder = self.root / "incoming" / secrets.token_hex(8)
        folder.mkdir()
        return folder

    def snapshot(self, xet_hashes: Iterable[str], corrupt: Callable[[str], str | None] = lambda h: None) -> Path:
        """A read folder holding the store's shards, the xorbs of ``xet_hashes`` and a copy of its database.
        ``corrupt(xet_hash)``: "flip" or "truncate" to serve that file from a damaged copy of its first xorb
        (what a faulty disk or transfer does to the bytes a Xet download gets); None keeps it intact."""
        self._expire_snapshots()
        folder = self.root / "read" / f"{int(time.time())}-{secrets.token_hex(6)}"
        src, dst = _xorbs(self.root / "store"), _xorbs(folder)
        with self.lock:
            files = self.store_files()
            (dst / "shards").mkdir(parents=True)
            (dst / "xorbs").mkdir()
            for shard in (src / "shards").glob("*"):
                os.link(shard, dst / "shards" / shard.name)
            for xet_hash in set(xet_hashes):
                info = files.get(xet_hash)
                if info is None:
                    continue
                damage = corrupt(xet_hash)
                for i, seg in enumerate(info.segments):
                    name = f"default.{seg.xorb}"
                    if (dst / "xorbs" / name).exists():
                        continue
                    if i == 0 and damage is not None:
                        _damaged_copy(src / "xorbs" / name, dst / "xorbs" / name, damage)
                    else:
                        os.link(src / "xorbs" / name, dst / "xorbs" / name)
            database = src / "global_dedup_lookup.redb"
            if database.exists():
                shutil.copyfile(database, dst / database.name)
        return folder

    def _expire_snapshots(self) -> None:
        cutoff = time.time() - 2 * READ_TOKEN_S
        for old in (self.root / "read").iterdir():
            stamp = old.name.split("-", 1)[0]
            if stamp.isdigit() and int(stamp) < cutoff:
                shutil.rmtree(old, ignore_errors=True)

    # ---- what the shards say ------------------------------------------------------------------
    def store_files(self) -> dict[str, ShardFile]:
        out: dict[str, ShardFile] = {}
        for shard in (_xorbs(self.root / "store") / "shards").glob("*.mdb"):
            for f in self._parse(shard):
                out.setdefault(f.xet_hash, f)
        return out

    def claims(self, sha256: str) -> list[tuple[Path, ShardFile]]:
        """Files of the incoming folders whose uploader claimed ``sha256``, newest folder first."""
        found = []
        for folder in sorted((self.root / "incoming").iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
            for shard in (_xorbs(folder) / "shards").glob("*.mdb"):
                found += [(folder, f) for f in self._parse(shard) if f.claimed_sha256 == sha256]
        return found

    def _parse(self, shard: Path) -> list[ShardFile]:
        if shard not in self._seen:
            try:
                self._seen[shard] = parse_shard(shard.read_bytes())
            except (OSError, ValueError):
                return []  # still being written, or not a shard: looked at again next time
        return self._seen[shard]

    # ---- the commit-time check -----------------------------------------------------------------
    def known(self, sha256: str) -> str | None:
        path = self.root / "known" / sha256
        return path.read_text().strip() if path.is_file() else None

    def verify_claim(self, sha256: str, size: int, path: str, sink: Callable[[Iterator[bytes]], str]) -> None:
        """Hold the uploader of ``sha256`` to its claim: rebuild each claimed file and hash it (``sink`` consumes the
        bytes and returns their sha256, keeping them when they match). HubError 422 when no upload has those bytes."""
        claimed = [(folder, f) for folder, f in self.claims(sha256) if f.size == size]
        if not claimed:
            raise HubError(422, f"No upload holds {path} (sha256 {sha256}, {size} bytes): upload it before the commit")
        got = ""
        for folder, f in claimed:
            copy = self._private_copy(folder)  # the uploader's process may still hold its folder's database open
            try:
                got = sink(self.read(copy, f.xet_hash, size))
            finally:
                shutil.rmtree(copy, ignore_errors=True)
            if got == sha256:
                return
        raise HubError(422, f"The Xet upload of {path} claims sha256 {sha256}, but its bytes hash to {got}: "
                            "refusing a false claim")

    def _private_copy(self, folder: Path) -> Path:
        """A CAS folder of the server's own with ``folder``'s xorbs and shards (hard links: they are immutable) and a
        copy of its database, so that reading it never waits for (nor blocks) the process that wrote it."""
        copy = self.root / "read" / f"{int(time.time())}-claim-{secrets.token_hex(6)}"
        src, dst = _xorbs(folder), _xorbs(copy)
        for sub in ("xorbs", "shards"):
            (dst / sub).mkdir(parents=True)
            for item in (src / sub).glob("*"):
                os.link(item, dst / sub / item.name)
        database = src / "global_dedup_lookup.redb"
        if database.exists():
            shutil.copyfile(database, dst / database.name)
        return copy

    def read(self, folder: Path, xet_hash: str, size: int, start: int | None = None,
             end: int | None = None) -> Iterator[bytes]:
        """The bytes of one file of the CAS in ``folder`` (``end`` exclusive), rebuilt by hf_xet in this process."""
        import hf_xet

        group = self._open(lambda s: s.new_download_stream_group(endpoint=cas_url(folder)))
        try:
            yield from group.download_stream(hf_xet.XetFileInfo(xet_hash, size), start=start, end=end)
        finally:
            del group  # releases the folder's database for the next process

    def put(self, sha256: str, chunks: Iterator[bytes] | Path) -> str:
        """Upload verified bytes (a file, or chunks) into the store; returns and records their Xet hash."""
        with self.lock:
            known = self.known(sha256)
            if known is not None:
                return known
            commit = self._open(lambda s: s.new_upload_commit(endpoint=cas_url(self.root / "store")))
            with commit:
                if isinstance(chunks, Path):
                    handle = commit.start_upload_file(str(chunks), sha256=sha256)
                else:
                    stream = commit.start_upload_stream(name=sha256, sha256=sha256)
                    for chunk in chunks:
                        stream.write(chunk)
                    done = stream.finish()
            xet_hash = str((handle.result() if isinstance(chunks, Path) else done).xet_info.hash)
            del commit
            (self.root / "known" / sha256).write_text(xet_hash)
            return xet_hash

    def _open(self, make: Callable[[Any], Any]) -> Any:
        """``make(session)``, retried while another process still holds the folder's database (a client's upload
        commit lives until its call returns; it is closed before the client sends the commit)."""
        import hf_xet

        if self._session is None:
            self._session = hf_xet.XetSession()
        deadline = time.monotonic() + 20
        while True:
            try:
                return make(self._session)
            except RuntimeError as exc:
                if "already open" not in str(exc) or time.monotonic() > deadline:
                    raise HubError(503, f"Xet storage is busy: {exc}") from exc
                time.sleep(0.05)


def _damaged_copy(src: Path, dst: Path, how: str) -> None:
    data = bytearray(src.read_bytes())
    if how == "flip":
        data[min(len(data) - 1, 8 + 64)] ^= 0xFF  # inside the first chunk's data (its header is 8 bytes)
    else:
        del data[len(data) // 2:]
    dst.write_bytes(bytes(data))


def sha256_sink(dest: Path | None) -> Callable[[Iterator[bytes]], str]:
    """A ``verify_claim`` sink: hash the bytes and write them to ``dest`` (None: only hash them)."""
    def sink(chunks: Iterator[bytes]) -> str:
        digest = hashlib.sha256()
        with open(dest, "wb") if dest is not None else _Null() as fh:
            for chunk in chunks:
                digest.update(chunk)
                fh.write(chunk)
        return digest.hexdigest()
    return sink


class _Null:
    def write(self, data: bytes) -> int:
        return len(data)

    def __enter__(self) -> _Null:
        return self

    def __exit__(self, *exc: object) -> None:
        pass
