"""Stage 0: resolve the base model (a Hub repo at a pinned sha, or a local folder) without downloading weights.

Everything the plan needs (file list with sizes, model_index.json / config.json, the base card's
metadata) is read here; weights are only fetched by the snapshot stage.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from publisher.errors import SourceError, UsageError
from publisher.handoffs.plan import Source
from publisher.io import hub, jsonfile
from publisher.io.downloads import download
from publisher.io.integrity import hashes_of
from publisher.io.localfiles import allowed_roots, list_folder, named_folder, read_bytes

log = logging.getLogger(__name__)

_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def is_local(model_id: str) -> bool:
    return Path(model_id).expanduser().is_dir()


def shown(model_id: str) -> str:
    """MODEL_ID as the card's command line gives it: a Hub repo id as typed; a local folder as typed when that is a
    path below the working directory (``./my-pipeline``, ``models/my-pipeline``), else by its own name: an absolute
    path, ``~`` or ``..`` says where the folder sat on this machine (a home folder, a user name), nothing more."""
    typed = Path(model_id)
    local = typed.expanduser()
    if not local.is_dir():
        return model_id
    if local.is_absolute() or model_id.startswith("~") or ".." in typed.parts or typed.name in ("", "."):
        return local.resolve().name
    return model_id


def check_named_folder(model_id: str) -> None:
    """A MODEL_ID written as a path to a folder that does not exist (or a file) is a usage error that says so, before
    a token or the Hub is asked anything; otherwise it would be taken for a repo id and fail as one."""

    named_folder(model_id, "MODEL_ID")


def resolve(model_id: str, revision: str | None, token: str | None) -> Source:
    """Pin the base model: check it exists, is readable, and resolve the revision to a sha."""
    if is_local(model_id):
        if revision:
            raise UsageError(f"--revision {revision!r} only applies to a Hub repo, not the local folder {model_id}")

        root = Path(model_id).expanduser().resolve()
        sizes = list_folder(root)  # refuses links that leave the folder, and special files
        card = {}
        if "README.md" in sizes:
            text = read_bytes(root / "README.md", allowed_roots(root)).decode("utf-8", errors="replace")
            card = _front_matter(text)
        return Source(model_id=model_id, repo_id=None, local_dir=root, revision=None, sha=None, sizes=sizes, card_data=card)

    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model_id)
    except HFValidationError:
        raise UsageError(
            f"MODEL_ID {model_id!r} is neither an existing local folder nor a Hub repo id; "
            "use the form org/name (e.g. black-forest-labs/FLUX.1-dev) or a path to a model folder"
        ) from None
    # Hub errors (not found, gated, bad revision, unreachable) propagate as huggingface_hub
    # exceptions; the CLI maps them to one-line messages in one place.
    from huggingface_hub.errors import RevisionNotFoundError

    try:
        info = hub.call(hub.client(token).model_info, model_id, revision=revision, files_metadata=True,
                          what=f"reading {model_id}")
    except RevisionNotFoundError:
        raise SourceError(
            f"revision {revision!r} not found in {model_id}; pass an existing branch, tag or commit sha with --revision"
        ) from None
    if getattr(info, "disabled", False):
        raise SourceError(f"{model_id} is disabled on the Hub and cannot be used as a base")
    if not info.sha or not _SHA_RE.match(info.sha):
        raise SourceError(f"the Hub returned no commit sha for {model_id}@{revision or 'main'}")
    sizes = {s.rfilename: int(s.size or 0) for s in (info.siblings or [])}
    card = dict(info.card_data.to_dict()) if info.card_data else {}
    return Source(
        model_id=model_id,
        repo_id=model_id,
        local_dir=None,
        revision=revision,
        sha=info.sha,
        sizes=sizes,
        card_data=card,
        endpoint=constants.ENDPOINT,
        hashes=hashes_of(info.siblings),
        gated=bool(getattr(info, "gated", False)),
    )


def _front_matter(text: str) -> dict[str, Any]:
    """The YAML metadata block of a model card, or {} (a broken block is not an error here)."""
    from huggingface_hub import ModelCard

    try:
        return dict(ModelCard(text, ignore_metadata_errors=True).data.to_dict())
    except ValueError:
        return {}


# The base's small files, read for the plan. The pinned Source is a hand-off (data); reading its files, with their
# checks, is this stage's.
def read_json(source: Source, path: str, token: str | None) -> dict[str, Any]:
    """A JSON file of the base (model_index.json, a config, an index) as an object, through the one JSON reader; its
    size limit is checked from the listing first, so an oversized file is never downloaded."""
    what = source.where(path)
    limit = jsonfile.limit_for(path)
    if source.sizes.get(path, 0) > limit:
        raise jsonfile.too_big(what, source.sizes[path], limit)
    return jsonfile.read_object(local_path(source, path, token), what, limit, roots=base_roots(source))


def base_roots(source: Source) -> tuple[Path, ...] | None:
    """Where a local base's files may resolve to (links never lead outside the folder); None for a Hub base."""
    return allowed_roots(source.local_dir) if source.local_dir is not None else None


def local_path(source: Source, path: str, token: str | None) -> Path:
    """A small file of the base on local disk (downloaded at the pinned sha for a Hub base)."""
    if path not in source.sizes:
        raise SourceError(f"{source.display} has no file {path}")
    if source.local_dir is not None:
        return source.local_dir / path
    # a Hub file is checked against the hash its repo records before anything reads it
    return download(source.repo_id, source.sha, [path], source.hashes, token) / path  # type: ignore[arg-type]
