"""`verify TARGET` reads only bytes it has checked: the target's files against the hashes the Hub reports for them,
and the recorded base's files against the hashes the target recorded when it was made (``base_files`` in
hf_ao_publish.json) as well as the Hub's own.

A target file whose bytes differ from the Hub's hash is a corrupted download (removed from the cache, "download
again"); a base file whose Hub hash differs from the recorded one means the target was not made from this base,
and verification fails naming the file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from publisher.errors import VerificationError
from publisher.io import downloads, hub
from publisher.io.integrity import FileHash, hashes_of

log = logging.getLogger(__name__)

AFTER = "nothing was verified"
WEIGHT_FILES = (".json", ".safetensors", ".bin")  # a component's configs, index and weights


def _needed(files: list[str]) -> list[str]:
    """A folder's files the loaders read: its pickle .bin weights only where it has no safetensors (as they choose)."""
    folders_with_st = {f.rpartition("/")[0] for f in files if f.endswith(".safetensors")}
    return sorted(f for f in files if not (f.endswith((".bin", ".bin.index.json")) and f.rpartition("/")[0] in folders_with_st))


def hub_sha(repo_id: str, revision: str | None, token: str | None) -> str:
    """The commit a Hub repo's revision (default: main) points at; the Hub's errors propagate."""
    return _hub_hashes(repo_id, revision, token)[0]


def fetch_base_index(base: str, sha: str, token: str | None) -> Path:
    """The base's model_index.json or root config.json (whichever it has), checked against the Hub's hashes."""
    _, now = _hub_hashes(base, sha, token)
    files = [f for f in ("model_index.json", "config.json") if f in now][:1]
    return downloads.download(base, sha, files, now, token, after=AFTER)


def _hub_hashes(repo_id: str, revision: str | None, token: str | None) -> tuple[str, dict[str, FileHash]]:
    info = hub.call(hub.client(token).model_info, repo_id, revision=revision, files_metadata=True,
                    what=f"reading {repo_id}")
    return str(info.sha), hashes_of(info.siblings)


def _direct(path: str, folder: str) -> bool:
    """``path`` is a file directly inside ``folder`` ("" for the repo root)."""
    prefix = f"{folder}/" if folder else ""
    return path.startswith(prefix) and "/" not in path[len(prefix):]


def fetch_target_configs(target: str, revision: str | None, token: str | None, state_file: str
                         ) -> tuple[Path, str, dict[str, FileHash]]:
    """The target's state file, model_index.json and every config.json (root and one level down), checked against the
    Hub's hashes; returns (the local snapshot folder, the resolved commit sha, the Hub's hashes of every file)."""
    sha, hashes = _hub_hashes(target, revision, token)
    files = sorted(f for f in hashes if f in (state_file, "model_index.json", "config.json", "README.md")
                   or (f.count("/") == 1 and f.endswith("/config.json")))
    folder = downloads.download(target, sha, files, hashes, token, after=AFTER)
    log.info("%d files of %s@%s checked against the Hub's hashes", len(files), target, sha[:12])
    return folder, sha, hashes


def fetch_target_components(target: str, sha: str, hashes: dict[str, FileHash], components: list[str],
                            token: str | None) -> None:
    """The quantized components' configs and weights (what the load paths read: safetensors, else a pickle .bin),
    checked against the Hub's hashes."""
    files = _needed([f for f in hashes if f.endswith(WEIGHT_FILES) and any(_direct(f, c) for c in components)])
    downloads.download(target, sha, files, hashes, token, after=AFTER)
    log.info("%d weight and config files of %s@%s checked against the Hub's hashes", len(files), target, sha[:12])


def fetch_base_component(base: str, sha: str, component: str, recorded: Any, target: str, token: str | None) -> Path:
    """One component folder of the recorded base at ``sha``: every file the target recorded (``recorded``: the state's
    ``base_files``; None for a state without them, then the Hub's listing) must have the recorded hash on the Hub,
    and each download must have it too. Returns the local snapshot folder of the base."""
    _, now = _hub_hashes(base, sha, token)
    record = {f: FileHash.from_json(v) for f, v in recorded.items()} if isinstance(recorded, dict) else None
    files = _needed([f for f in (record if record is not None else now)
                     if _direct(f, component) and f.endswith(WEIGHT_FILES)])
    for f in files if record is not None else ():
        mine, theirs = record[f], now.get(f)  # type: ignore[index]
        if mine is None:
            raise VerificationError(f"{target}: the hash its state file records for the base file {f} cannot be read; "
                                    "the state file was edited or written by another tool")
        if theirs is None:
            raise VerificationError(f"{target} records the base file {f} of {base}@{sha[:12]}, which is not there on the "
                                    "Hub: the target was not made from this base")
        if theirs.digest != mine.digest:
            raise VerificationError(f"the base file {f} of {base}@{sha[:12]} has {theirs.kind} {theirs.digest} on the "
                                    f"Hub, but {target} records {mine.digest}: the target was not made from this base")
    folder = downloads.download(base, sha, files, now, token, after=AFTER)
    log.info("%d files of the base %s@%s checked against %s", len(files), base, sha[:12],
             "the hashes the target recorded" if record is not None else "the Hub's hashes (the target records none)")
    return folder
