"""A small JSON file of entries kept for a while beside a cache: what one run learnt that later runs reuse until it
expires (the environments that could not be built, verify/envs.py; the newest releases found, compat.py).

Each entry is a JSON object with ``at`` (when it was learnt, seconds since the epoch). A missing, damaged or unreadable
file is an empty one (the next run learns again); writing replaces the file whole (a temporary file renamed into
place), so a reader never sees half of it, and a read-only cache is no error (nothing is kept). Concurrent writers:
the last one's file wins, and what the other learnt is learnt again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def read(path: Path, ttl_s: float, now: float | None = None) -> dict[str, dict[str, Any]]:
    """The file's entries younger than ``ttl_s``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none kept yet, or a damaged file
        return {}
    now = time.time() if now is None else now
    return {k: v for k, v in data.items() if _fresh(v, ttl_s, now)} if isinstance(data, dict) else {}


def keep(path: Path, entries: dict[str, dict[str, Any]], ttl_s: float) -> None:
    """Add ``entries`` (each given its ``at`` when it has none) to the file, dropping the expired ones."""
    now = time.time()
    data = {**read(path, ttl_s, now), **{k: {"at": now, **v} for k, v in entries.items()}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: learnt again next run, nothing else changes
        log.debug("nothing kept in %s: %s", path, exc)


def _fresh(entry: object, ttl_s: float, now: float) -> bool:
    at = entry.get("at") if isinstance(entry, dict) else None
    return isinstance(at, (int, float)) and 0 <= now - at < ttl_s
