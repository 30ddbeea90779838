"""Downloads from the Hub that are checked before anything reads them.

Each file is fetched with huggingface_hub's ``hf_hub_download`` into its cache (so re-runs and resumes share it),
one file at a time in this thread (a SIGINT/SIGTERM then stops the transfer at once and huggingface_hub removes
its temporary file; a thread pool would first finish every transfer in flight), and hashed against the Hub's
own hash for that file (``integrity.FileHash``). A copy whose bytes differ is removed from the cache, its
snapshot link and its blob, so the next run downloads it afresh; the error names the file and both hashes.

Through Xet (huggingface_hub's default), the repo's ``blobs/<etag>`` entry is a link into the cache-wide shared
blob store (``<cache>/blobs/<2 hex>/<xet hash>``), which other repos with the same file link to too (FLUX.1-schnell
shares FLUX.1-dev's VAE and text encoders), and hf_xet does not check the bytes it reassembles. A store file that
fails the check is never deleted (other repos' snapshots point at it): only this repo's two links go, and the file
is downloaded once more outside the shared store (``local_dir``) and checked. A good copy becomes this repo's own blob
and also replaces the store file's content, atomically (the links of other repos keep resolving, now to the right
bytes, which those repos' own loads would not have checked). When that copy is wrong too, the store file is left as it
was, the run stops, and the warning names the file, which the user may delete.

A body that arrives short ("Consistency check failed" from huggingface_hub: the connection ended cleanly
before the announced size) is retried like a dropped connection (publisher.io.hub); when every try was short,
the error says so in one line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from publisher.errors import SourceError
from publisher.io import hub
from publisher.io.integrity import FileHash, hash_file, mismatch
from publisher.io.localfiles import in_shared_blob_store

log = logging.getLogger(__name__)


def snapshot_folder(repo_id: str, sha: str) -> Path:
    """huggingface_hub's cache folder for one commit of a model repo (created when missing)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / sha
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def shared_copy(path: Path) -> bool:
    """Whether a cached file's repo blob is a link into huggingface_hub's shared blob store (a Xet download): the
    store the cache marks as one (localfiles), never any link a user made."""
    blob = _repo_blob(path)
    # blob: <cache>/models--org--name/blobs/<etag>
    return blob is not None and blob.is_symlink() and in_shared_blob_store(blob, blob.parent.parent.parent)


def _repo_blob(path: Path) -> Path | None:
    """The repo's ``blobs/<etag>`` entry a snapshot link points to (not followed further)."""
    if not path.is_symlink():
        return None
    return Path(os.path.normpath(path.parent / os.readlink(path)))


def discard_cached(path: Path) -> None:
    """Remove this repo's cached copy of a file: the snapshot link and the repo's blob entry, so that nothing can read
    it again and the next hf_hub_download fetches it afresh (a plain file, where the cache holds copies). A blob entry
    that links into the shared store is unlinked; the store file itself, which other repos may link to, stays."""
    blob = _repo_blob(path)
    path.unlink(missing_ok=True)
    if blob is not None:
        blob.unlink(missing_ok=True)


def download(repo_id: str, sha: str, files: Iterable[str], hashes: Mapping[str, FileHash], token: str | None,
             *, after: str = "nothing was published") -> Path:
    """Bring ``files`` of ``repo_id`` at commit ``sha`` into the cache, each checked against ``hashes`` (the Hub's);
    returns the snapshot folder. ``after``: what the mismatch message says about the state of the run."""
    folder = snapshot_folder(repo_id, sha)
    for name in files:
        expected = hashes.get(name)
        if expected is None:
            raise SourceError(f"the Hub reported no sha256 or blob id for {name} of {repo_id}@{sha[:12]}, so its download "
                              "cannot be checked; use a Hub endpoint that reports file metadata (files_metadata)")
        label = f"{name} of {repo_id}@{sha[:12]}"
        path = fetch_file(repo_id, sha, name, token)
        got = hash_file(path, expected)
        if got != expected.digest and shared_copy(path):
            store = Path(os.path.realpath(path))
            log.warning("%s: the shared cache copy %s does not match the Hub's %s; downloading it again outside the "
                        "shared store (other repos link to that file: it is only replaced by bytes that pass the check)",
                        label, store, expected.kind)
            path, got = _own_copy(repo_id, sha, name, token, path, expected)
            if got == expected.digest:
                _repair_shared(store, path)
        if got != expected.digest:
            discard_cached(path)
            raise mismatch(label, expected, got, "downloaded bytes", f"the corrupt copy was removed from the cache and {after}")
    return folder


def _own_copy(repo_id: str, sha: str, name: str, token: str | None, path: Path,
              expected: FileHash) -> tuple[Path, str]:
    """Replace this repo's link to a shared copy with a fresh download of its own (made outside the shared store);
    (its snapshot path, its digest). The repo's blob becomes a regular file, as for a plain HTTP download."""
    import shutil
    import tempfile

    blob = _repo_blob(path)
    assert blob is not None
    discard_cached(path)
    tmp = Path(tempfile.mkdtemp(prefix=".hf-ao-publish-", dir=blob.parent))
    try:
        fresh = fetch_file(repo_id, sha, name, token, local_dir=tmp)
        got = hash_file(fresh, expected)
        os.replace(fresh, blob)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(blob, path.parent), path)
    return path, got


def _repair_shared(store: Path, good: Path) -> None:
    """Give a shared store file the bytes of a checked copy, atomically (never deleted: other repos link to it)."""
    import secrets
    import shutil

    tmp = store.with_name(f".hf-ao-publish-{secrets.token_hex(6)}")
    try:
        shutil.copyfile(good, tmp)
        os.replace(tmp, store)
        log.info("replaced the shared cache copy %s with the checked bytes", store)
    except OSError as exc:  # a read-only cache: this repo has its own good copy; the others keep what they had
        log.warning("could not repair the shared cache copy %s (%s)", store, exc)
    finally:
        tmp.unlink(missing_ok=True)


def fetch_file(repo_id: str, sha: str, name: str, token: str | None, *, local_dir: Path | None = None) -> Path:
    """hf_hub_download with our retries, a short body counted as transient; the cached path (not yet checked).
    ``local_dir``: download into that folder instead of the cache (a fresh copy, never the shared store's)."""
    from huggingface_hub import hf_hub_download

    extra: dict[str, Any] = {"local_dir": local_dir, "force_download": True} if local_dir is not None else {}
    try:
        return Path(hub.call(hf_hub_download, repo_id, name, revision=sha, token=token, **extra,
                             what=f"downloading {name} of {repo_id}"))
    except OSError as exc:
        if hub.is_short_body(exc):
            raise SourceError(f"downloading {name} of {repo_id}@{sha[:12]} from {hub.endpoint()} failed: the body was "
                              f"cut short on each of {hub.settings()[0]} tries ({hub.short(exc)}); check the network "
                              "or proxy, then re-run the same command (finished files stay in the cache)") from exc
        if hub.is_xet_failure(exc):
            raise _xet_failed(repo_id, sha, name, exc) from exc
        raise
    except RuntimeError as exc:  # hf_xet's own errors
        raise _xet_failed(repo_id, sha, name, exc) from exc


def _xet_failed(repo_id: str, sha: str, name: str, exc: BaseException) -> SourceError:
    return SourceError(f"downloading {name} of {repo_id}@{sha[:12]} through Xet failed on each of {hub.settings()[0]} "
                       f"tries ({type(exc).__name__}: {str(exc).strip()[:160]}); re-run the same command (finished files "
                       "stay in the cache), or set HF_HUB_DISABLE_XET=1 to download over plain HTTP")
