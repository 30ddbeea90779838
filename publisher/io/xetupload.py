"""Xet, as huggingface_hub uses it by default, where it has no API for what we do: uploading a stream of bytes.

huggingface_hub uploads paths and bytes through Xet whenever hf_xet is importable and ``HF_HUB_DISABLE_XET`` is
unset (on huggingface.co, and on any Hub that serves Xet tokens, our loopback Hub included); a file object would
fall back to the legacy LFS path with a warning. A Hub-to-Hub copy (``stages/hubcopy.py``) reads the base file over
HTTP and must not hold it whole, so its bytes are fed to hf_xet's own streaming upload (``start_upload_stream``)
here, with the same token route (``/api/models/{repo}/xet-write-token/{rev}``) and headers huggingface_hub sends.
hf_xet hashes what it chunks (``COMPUTE_SHA256``): that digest, not a claim of ours, is what the commit names, and
it is compared with the digest the reader took of the same bytes before anything is committed.

The file then joins a commit as an operation that is already uploaded (``uploaded_operation``), as huggingface_hub's
own ``preupload_lfs_files`` leaves its operations.

hf_xet's download buffers are bounded here too (``bound_memory``): by default it sizes them from the machine's
memory (about 1.6 GB to buffer a download; a 2 GiB file peaked at 1.12-1.19 GiB RSS here), which alone would take
most of the process budget of docs/streaming.md. The values are read when hf_xet starts a session, so the CLI sets them at
start; a user's own ``HF_XET_*`` settings win.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from publisher import __version__

# hf_xet reads these when it builds a session (HF_XET_<GROUP>_<FIELD>). Measured here (benchmarks/bench_xet.py and
# docs/benchmarks.md, a 2 GiB file of non-repeating data from the loopback Hub's Xet store, fresh process each):
# hf_xet's defaults 1.12-1.19 GiB peak RSS; 128 MB of download buffer 0.41-0.43 GiB; these (64 MB) 0.29 GiB, at the
# same speed on that local CAS. 64 MB in flight is still ten times a 1 Gbit/s link's bandwidth-delay product at 50 ms.
MEMORY_BOUND = {
    "HF_XET_RECONSTRUCTION_DOWNLOAD_BUFFER_SIZE": str(64 * 10**6),
    "HF_XET_RECONSTRUCTION_DOWNLOAD_BUFFER_PERFILE_SIZE": str(32 * 10**6),
    "HF_XET_RECONSTRUCTION_DOWNLOAD_BUFFER_LIMIT": str(128 * 10**6),
    "HF_XET_RECONSTRUCTION_MIN_PREFETCH_BUFFER": str(32 * 10**6),
    "HF_XET_RECONSTRUCTION_MIN_RECONSTRUCTION_FETCH_SIZE": str(16 * 10**6),
}


def bound_memory() -> None:
    """Bound hf_xet's download buffers (before its first session; the user's own settings are kept)."""
    for key, value in MEMORY_BOUND.items():
        os.environ.setdefault(key, value)


def enabled() -> bool:
    """Whether huggingface_hub uploads through Xet in this process (the constant is read when it is imported)."""
    import importlib.util

    from huggingface_hub import constants

    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


@dataclass(frozen=True)
class Uploaded:
    sha256: str  # what hf_xet computed from the bytes it was given
    size: int
    xet_hash: str


_session_lock = threading.Lock()
_session: Any = None


def _get_session() -> Any:
    global _session
    import hf_xet

    with _session_lock:
        if _session is None:
            _session = hf_xet.XetSession()
        return _session


def _drop_session() -> None:
    """After an interrupt: cancel what is in flight; the next upload starts a fresh session."""
    global _session
    with _session_lock:
        if _session is not None:
            try:
                _session.sigint_abort()
            finally:
                _session = None


def upload_stream(repo_id: str, chunks: Iterable[bytes | memoryview], *, token: str | None, name: str,
                  revision: str = "main") -> Uploaded:
    """Upload the bytes of ``chunks`` to the Xet storage of ``repo_id`` (nothing is committed). An error raised by
    ``chunks`` (the reader's hash check) aborts the upload: hf_xet then registers no file."""
    import hf_xet
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers


    headers = build_hf_headers(token=token or None, library_name="hf-ao-publish", library_version=__version__)
    refresh = f"{constants.ENDPOINT.rstrip('/')}/api/models/{repo_id}/xet-write-token/{revision}"
    session = _get_session()
    size = 0
    try:
        with session.new_upload_commit(token_refresh_url=refresh, token_refresh_headers=headers,
                                       custom_headers={k: v for k, v in headers.items() if k.lower() != "authorization"},
                                       ) as commit:
            stream = commit.start_upload_stream(name=name, sha256=hf_xet.COMPUTE_SHA256)
            try:
                for chunk in chunks:
                    stream.write(chunk if isinstance(chunk, bytes) else bytes(chunk))
                    size += len(chunk)
            except BaseException:
                stream.abort()
                raise
            meta = stream.finish()
    except KeyboardInterrupt:
        _drop_session()
        raise
    info = meta.xet_info
    return Uploaded(str(info.sha256), size, str(info.hash))


def uploaded_operation(path_in_repo: str, size: int, sha256: str, sample: bytes) -> Any:
    """A ``CommitOperationAdd`` for bytes already in the target's storage: ``create_commit`` names it by sha256
    (an ``lfsFile``) without reading or uploading anything. huggingface_hub has no public constructor for this; the
    two fields set here are the ones its ``preupload_lfs_files`` sets once it has uploaded an operation."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.lfs import UploadInfo

    op = CommitOperationAdd(path_in_repo=path_in_repo, path_or_fileobj=b"")
    op.upload_info = UploadInfo(size=size, sample=sample, sha256=bytes.fromhex(sha256))
    op._upload_mode = "lfs"
    op._is_uploaded = True
    return op
