"""Stage 2: bring exactly the planned base files onto local disk (nothing for a local folder)."""

from __future__ import annotations

import glob
import logging
from pathlib import Path

from .plan import Plan

log = logging.getLogger(__name__)


def fetch(plan: Plan, token: str | None) -> Path:
    """Download the planned files at the pinned sha into the huggingface_hub cache; return the folder.

    allow_patterns lists exact file names, so a root single-file checkpoint (FLUX.1-dev's 23.8 GB
    flux1-dev.safetensors) or a second weight format is never downloaded.
    """
    source = plan.source
    if source.local_dir is not None:
        return source.local_dir
    from huggingface_hub import snapshot_download

    from . import retry

    total = sum(source.sizes.get(f, 0) for f in plan.base_files)
    log.info("downloading %d files (%.1f MB) of %s", len(plan.base_files), total / 1e6, source.display)
    # allow_patterns are fnmatch patterns: escape names so "[", "*" or "?" in a file name match only it.
    folder = retry.call(
        snapshot_download,
        source.repo_id,  # type: ignore[arg-type]
        revision=source.sha,
        allow_patterns=[glob.escape(f) for f in plan.base_files],
        token=token,
        what=f"downloading {source.display}",  # resumes from the cache on a retry
    )
    return Path(folder)
