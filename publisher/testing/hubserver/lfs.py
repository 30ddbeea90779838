"""LFS uploads (the client's path when Xet is off, or for file objects), and how committed objects become entries.

* ``POST /{repo}.git/info/lfs/objects/batch`` answers one presigned PUT per object, or, above the server's
  ``multipart_threshold``, huggingface_hub's multipart form: ``header`` holds ``chunk_size`` and one URL per part
  under the keys "1", "2", ..., and ``href`` is the completion URL.
* ``PUT /_lfs/upload/{oid}`` takes a whole object, ``PUT /_lfs/part/{oid}/{n}`` one part (answered with an ETag, as
  S3 does); ``POST /_lfs/complete/{oid}`` assembles the parts in order, re-hashes the whole object and only then
  adopts it. A body whose size or sha256 differs from what the batch announced is refused; nothing half-written is
  ever stored. The client sends no ``Authorization`` to these URLs (they are presigned), so each carries a signature.
* ``lfs_entry`` turns a commit's ``lfsFile`` into a tree entry: an LFS upload is checked already; anything else must
  be a Xet upload, held to its sha256 claim (xet.py). Either way the bytes end up in the Xet store.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import shutil
from math import ceil
from pathlib import Path

from publisher.testing.hubserver.access import HubAccess
from publisher.testing.hubserver.storage import HubError, make_entry
from publisher.testing.hubserver.wire import Request, Response, json_response
from publisher.testing.hubserver.xet import sha256_sink

_LFS_JSON = {"Content-Type": "application/vnd.git-lfs+json"}
_OID = re.compile(r"[0-9a-f]{64}")


class LfsRoutes(HubAccess):
    multipart_threshold: int | None = None  # objects above this many bytes are uploaded in parts
    multipart_chunk: int = 5 * 1024 * 1024

    def _lfs_sig(self, oid: str, size: int, upload: str = "") -> str:
        return hmac.new(self.store.secret, f"{oid}:{size}:{upload}".encode(), hashlib.sha256).hexdigest()

    def _signed(self, req: Request, what: str, oid: str, size: int, upload: str = "") -> str:
        """A presigned URL; ``upload``: the multipart upload it belongs to (each batch answer starts its own, as S3's
        upload ids do, so two clients sending the same object at once never mix their parts)."""
        query = f"size={size}&upload={upload}" if upload else f"size={size}"
        return f"{req.base_url}/_lfs/{what}?{query}&sig={self._lfs_sig(oid, size, upload)}"

    def lfs_batch(self, req: Request, repo_type: str, repo_id: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        if req.user is None:
            raise HubError(401, "You must be authenticated to upload LFS objects (no token sent)")
        self.require_permission(req, "repo.write", meta["id"])
        body = req.json()
        if body.get("operation") != "upload":
            raise HubError(400, "Only the 'upload' LFS operation is supported; download through resolve/")
        objects = []
        for obj in body.get("objects", []):
            oid, size = str(obj.get("oid", "")), obj.get("size")
            if not _OID.fullmatch(oid) or not isinstance(size, int) or size < 0:
                objects.append({"oid": oid, "size": size, "error": {"code": 422, "message": "Invalid oid or size"}})
            elif self.store.has_blob(oid, size):
                objects.append({"oid": oid, "size": size})  # no "actions": the client skips the upload
            elif self.multipart_threshold is not None and size > self.multipart_threshold:
                parts, upload = ceil(size / self.multipart_chunk), secrets.token_hex(8)
                header = {"chunk_size": str(self.multipart_chunk)}
                header.update({str(n): self._signed(req, f"part/{oid}/{n}", oid, size, upload) for n in range(1, parts + 1)})
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {"upload": {
                    "href": self._signed(req, f"complete/{oid}", oid, size, upload), "header": header,
                    "expires_in": 86400}}})
            else:
                # The client PUTs without Authorization (it expects a presigned URL): sign oid+size instead.
                objects.append({"oid": oid, "size": size, "authenticated": True, "actions": {"upload": {
                    "href": self._signed(req, f"upload/{oid}", oid, size), "expires_in": 86400}}})
        return json_response({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}, headers=_LFS_JSON)

    def lfs_put(self, req: Request, parts: list[str]) -> Response:
        """The presigned URLs: a whole object, one part, or the completion of a multipart upload."""
        kind = parts[0] if parts else ""
        oid = parts[1] if len(parts) > 1 else ""
        size_s, sig, upload = req.q("size") or "", req.q("sig") or "", req.q("upload") or ""
        shape = {"upload": ("PUT", 2), "part": ("PUT", 3), "complete": ("POST", 2)}.get(kind)
        if shape is None or (req.method, len(parts)) != shape or not _OID.fullmatch(oid) or (
                (kind == "upload") == bool(upload)) or not re.fullmatch(r"[0-9a-f]*", upload):
            raise HubError(404, f"Not found: {req.path}")
        if not size_s.isdigit() or not hmac.compare_digest(sig, self._lfs_sig(oid, int(size_s), upload)):
            raise HubError(403, "Invalid or missing signature on the LFS upload URL")
        size = int(size_s)
        if kind == "upload":
            return self._receive(req, oid, size, None, "")
        if kind == "part":
            if not parts[2].isdigit() or not 1 <= int(parts[2]) <= ceil(size / self.multipart_chunk):
                raise HubError(400, f"Invalid part number {parts[2]!r}")
            return self._receive(req, oid, size, int(parts[2]), upload)
        return self._complete(req, oid, size, upload)

    def _parts_dir(self, oid: str, upload: str) -> Path:
        return self.store.root / "tmp" / f"parts-{oid}-{upload}"

    def _receive(self, req: Request, oid: str, size: int, part: int | None, upload: str) -> Response:
        """Stream a body to a temp file: a whole object is adopted once its size and sha256 match; a part is kept
        (with its md5 as its ETag) until the completion. A dropped connection leaves nothing behind."""
        fault = self.faults.take("drop_upload", "PUT", req.path)
        limit = size if part is None else min(self.multipart_chunk, size - (part - 1) * self.multipart_chunk)
        fd, tmp = self.store.new_tmp()
        kept, received, digest, md5 = False, 0, hashlib.sha256(), hashlib.md5()
        try:
            with os.fdopen(fd, "wb") as fh:
                for chunk in req.iter_body():
                    if fault is not None and received + len(chunk) >= fault.drop_after:
                        return Response(drop=True)
                    received += len(chunk)
                    if received > limit:
                        raise HubError(400, f"LFS upload for {oid} is larger than the announced {limit} bytes")
                    digest.update(chunk)
                    md5.update(chunk)
                    if part is not None or not self.store.discard_lfs:
                        fh.write(chunk)
            if fault is not None:
                return Response(drop=True)
            if part is not None:
                if received != limit:
                    raise HubError(400, f"part {part} of {oid} has {received} bytes, expected {limit}")
                folder = self._parts_dir(oid, upload)
                folder.mkdir(exist_ok=True)
                os.replace(tmp, folder / str(part))
                kept = True
                return Response(200, headers={"ETag": f'"{md5.hexdigest()}"'})
            if received != size or digest.hexdigest() != oid:
                raise HubError(400, f"LFS upload does not match: got {received} bytes with sha256 "
                                    f"{digest.hexdigest()}, expected {size} bytes with sha256 {oid}")
            self.store.adopt_upload(tmp, oid, size)
            kept = True
            return Response(200)
        finally:
            if not kept:
                os.unlink(tmp)

    def _complete(self, req: Request, oid: str, size: int, upload: str) -> Response:
        body = req.json()
        folder = self._parts_dir(oid, upload)
        count = ceil(size / self.multipart_chunk)
        listed = body.get("parts") if isinstance(body, dict) else None
        if body.get("oid") != oid or not isinstance(listed, list) or [p.get("partNumber") for p in listed] != list(
                range(1, count + 1)):
            raise HubError(400, f"The completion of {oid} must list parts 1 to {count} in order")
        fd, tmp = self.store.new_tmp()
        adopted, digest, received = False, hashlib.sha256(), 0
        try:
            with os.fdopen(fd, "wb") as out:
                for entry in listed:
                    path = folder / str(entry["partNumber"])
                    if not path.is_file():
                        raise HubError(400, f"part {entry['partNumber']} of {oid} was never uploaded")
                    data = path.read_bytes()
                    if f'"{hashlib.md5(data).hexdigest()}"' != str(entry.get("etag")):
                        raise HubError(400, f"part {entry['partNumber']} of {oid}: ETag {entry.get('etag')} does not "
                                            "match the part received")
                    digest.update(data)
                    received += len(data)
                    if not self.store.discard_lfs:
                        out.write(data)
            if received != size or digest.hexdigest() != oid:
                raise HubError(400, f"the assembled parts of {oid} have {received} bytes with sha256 "
                                    f"{digest.hexdigest()}, expected {size} bytes with sha256 {oid}")
            self.store.adopt_upload(tmp, oid, size)
            adopted = True
        finally:
            if not adopted:
                os.unlink(tmp)
            shutil.rmtree(folder, ignore_errors=True)
        return json_response({})

    # ---- commit ------------------------------------------------------------------------------
    def lfs_entry(self, oid: str, size: int | None, path: str) -> dict:
        """The tree entry of a committed ``lfsFile``: an LFS object (checked on upload) or a Xet upload held to its
        sha256 claim here; the bytes go into the Xet store unless the server drops them (``discard_lfs``)."""
        if not _OID.fullmatch(oid):
            raise HubError(422, f"Invalid LFS oid {oid!r} for {path}")
        stored = self.store.blob_size(oid)
        if stored is None:
            if size is None:
                raise HubError(422, f"LFS object {oid} for {path} was never uploaded")
            fd, tmp = self.store.new_tmp()
            os.close(fd)
            try:
                self.xet.verify_claim(oid, size, path, sha256_sink(None if self.store.discard_lfs else Path(tmp)))
                self.store.adopt_upload(tmp, oid, size)
            finally:
                Path(tmp).unlink(missing_ok=True)
            stored = size
        elif size is not None and size != stored:
            raise HubError(422, f"LFS object {oid} for {path} has {stored} bytes, not {size}")
        return make_entry(oid, stored, True, xet_hash=self.into_store(oid))

    def into_store(self, oid: str) -> str | None:
        """The Xet hash of a stored object, uploading it into the Xet store first if needed; None when its bytes are
        not kept (``discard_lfs``)."""
        known = self.xet.known(oid)
        if known is not None:
            return known
        blob = self.store.blob_path(oid)
        if blob.is_file():
            return self.xet.put(oid, blob)
        virtual = self.store.virtual(oid)
        if virtual is not None:
            return self.xet.put(oid, virtual.read(0, virtual.size - 1))
        return None
