"""Downloads from the Hub that are checked before anything reads them.

Each file is fetched with huggingface_hub's ``hf_hub_download`` into its cache (so re-runs and resumes share it),
one file at a time in this thread (a SIGINT/SIGTERM then stops the transfer at once and huggingface_hub removes
its temporary file; a thread pool would first finish every transfer in flight), and hashed against the Hub's
own hash for that file (``integrity.FileHash``). A copy whose bytes differ is removed from the cache, its
snapshot link and its blob, so the next run downloads it afresh; the error names the file and both hashes.

A body that arrives short ("Consistency check failed" from huggingface_hub: the connection ended cleanly
before the announced size) is retried like a dropped connection (publisher.hub); when every try was short,
the error says so in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

from publisher import hub
from publisher.errors import IntegrityError, SourceError
from publisher.integrity import FileHash, check_file

log = logging.getLogger(__name__)


def snapshot_folder(repo_id: str, sha: str) -> Path:
    """huggingface_hub's cache folder for one commit of a model repo (created when missing)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots" / sha
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def discard_cached(path: Path) -> None:
    """Remove a cached file: the snapshot link and the blob it points to, so that nothing can read it again and the
    next hf_hub_download fetches it afresh (a plain file, where the cache holds copies instead of links)."""
    if path.is_symlink():
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
    else:
        path.unlink(missing_ok=True)


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
        path = fetch_file(repo_id, sha, name, token)
        try:
            check_file(path, expected, f"{name} of {repo_id}@{sha[:12]}",
                       after=f"the corrupt copy was removed from the cache and {after}")
        except IntegrityError:
            discard_cached(path)
            raise
    return folder


def fetch_file(repo_id: str, sha: str, name: str, token: str | None) -> Path:
    """hf_hub_download with our retries, a short body counted as transient; the cached path (not yet checked)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hub.call(hf_hub_download, repo_id, name, revision=sha, token=token,
                             what=f"downloading {name} of {repo_id}"))
    except OSError as exc:
        if hub.is_short_body(exc):
            raise SourceError(f"downloading {name} of {repo_id}@{sha[:12]} from {hub.endpoint()} failed: the body was "
                              f"cut short on each of {hub.settings()[0]} tries ({hub.short(exc)}); check the network "
                              "or proxy, then re-run the same command (finished files stay in the cache)") from exc
        raise
