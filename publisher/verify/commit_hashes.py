"""Proof that the Hub holds exactly the bytes that were verified: file hashes, not a second download.

Every file of a commit is known here by the hashes taken on our side: the sha256 of each LFS object (computed
from the checked bytes before their upload, or the base's oid checked on the way for a file copied from the
base) and the git blob id of each small file. After a commit, the Hub's own record of the commit
(``model_info(files_metadata=True)``: each file's LFS sha256 and size, or its git blob id) must match them
file for file, with nothing missing and nothing extra. That costs one API call instead of reading the repo back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from publisher import loadpath
from publisher.errors import VerificationError
from publisher.handoffs.report import PathResult
from publisher.io import hub

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd

CHUNK = 8 << 20


@dataclass(frozen=True)
class CommitFile:
    """What a file of the commit must be: its size and the hashes known for it (either may be None)."""

    size: int
    sha256: str | None  # the LFS oid
    git_oid: str | None = None  # git blob sha1 (what the Hub reports for a regular file)


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def of_bytes(data: bytes) -> CommitFile:
    return CommitFile(len(data), hashlib.sha256(data).hexdigest(), git_blob_id(data))


def of_file(path: Path, small: int = 10 << 20) -> CommitFile:
    """sha256 of a file (one sequential read), and its git blob id when small enough to be a regular file."""
    size = path.stat().st_size
    if size <= small:
        return of_bytes(path.read_bytes())
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return CommitFile(size, h.hexdigest())


def check_uploaded(op: CommitOperationAdd, ours: CommitFile, repo_id: str) -> None:
    """After a pre-upload: the sha256 the uploader computed from the bytes it read (hf_xet while chunking, or
    huggingface_hub before an LFS upload) must be the one taken here of the verified file; the commit names that
    digest, so a mismatch is refused before anything is committed."""

    if getattr(op, "_upload_mode", None) != "lfs":
        return  # a regular file is committed from its bytes; the Hub's git blob id is checked after the commit
    got = op.upload_info.sha256.hex()
    if got != ours.sha256 or op.upload_info.size != ours.size:
        raise VerificationError(f"{op.path_in_repo}: the uploader read {op.upload_info.size} bytes with sha256 {got} "
                                f"for {repo_id}, but the verified file has sha256 {ours.sha256} ({ours.size} bytes); "
                                "nothing was committed")


def of_operation(op: CommitOperationAdd) -> CommitFile:
    """The hashes of a ``CommitOperationAdd``'s own bytes (a local path or bytes), taken here: never the sha256 an
    uploader reported (hf_xet's), which is what these are checked against."""
    source = op.path_or_fileobj
    if isinstance(source, bytes):
        return of_bytes(source)
    if isinstance(source, (str, Path)):
        return of_file(Path(source))
    raise TypeError(f"{op.path_in_repo}: an operation made from a file object has no bytes to hash here")  # none of ours


def check_commit(repo_id: str, revision: str, expected: dict[str, CommitFile], token: str | None,
                 component: str = "") -> PathResult:
    """Compare the Hub's record of ``revision`` with ``expected``, file by file; one ``PathResult``."""

    api = hub.client(token)
    info = hub.call(api.model_info, repo_id, revision=revision, files_metadata=True, what=f"reading the file hashes of {repo_id}")
    res = PathResult(component, "hashes", "current, from the Hub", loadpath.versions(), False)
    seen = {s.rfilename: s for s in info.siblings or []}
    lfs = regular = 0
    problems: list[str] = []
    for path, want in sorted(expected.items()):
        got = seen.get(path)
        if got is None:
            problems.append(f"{path} is missing")
            continue
        if got.lfs is not None:
            lfs += 1
            if want.sha256 is None or got.lfs.sha256 != want.sha256 or got.lfs.size != want.size:
                problems.append(f"{path} has sha256 {got.lfs.sha256[:12]} ({got.lfs.size} bytes) on the Hub, "
                                f"{(want.sha256 or 'unknown')[:12]} ({want.size} bytes) was verified")
        else:
            regular += 1
            if want.git_oid is None or got.blob_id != want.git_oid:
                problems.append(f"{path} has git blob {str(got.blob_id)[:12]} on the Hub, "
                                f"{(want.git_oid or 'unknown (an LFS file was expected)')[:12]} was verified")
    extra = sorted(set(seen) - set(expected))
    problems += [f"{p} is on the Hub but was not published by this run" for p in extra]
    res.tensors_checked = 0
    if problems:
        res.detail = f"{len(problems)} of {len(expected)} files differ from the verified bytes: {problems[0]}"
        return res
    res.ok = True
    res.detail = (f"{len(expected)} files equal to the verified bytes: {lfs} LFS sha256 and {regular} git blob ids "
                  f"of commit {info.sha[:12] if info.sha else revision[:12]}")
    return res
