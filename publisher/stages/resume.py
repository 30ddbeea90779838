"""Resume an interrupted run: finished quantized components, keyed by everything that decides their bytes.

A component folder is entered only when complete: its files are hard-linked (no extra disk) into a
temporary entry, a manifest with every file's size and sha256 is written, and the entry is renamed into
place. A later run with the same key re-checks the manifest before reusing anything, so a partial or
corrupted file is never taken as finished. Entries are dropped once their repo is published.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from publisher.stages.leftovers import MARKER

log = logging.getLogger(__name__)

MANIFEST = "hf-ao-publish-cache.json"


def default_root() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("HF_AO_PUBLISH_CACHE") or Path(constants.HF_HOME) / "hf-ao-publish" / "components")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, dst)


class ComponentCache:
    def __init__(self, root: Path, fingerprint: str) -> None:
        self.root = root
        self.fingerprint = fingerprint

    def _entry(self, component: str) -> Path:
        key = hashlib.sha256(f"{self.fingerprint}/{component}".encode()).hexdigest()[:32]
        return self.root / key

    def store(self, component: str, folder: Path, summary: dict[str, Any]) -> None:
        """Record a finished component folder (its files hard-linked) with its summary (a JSON-able dict)."""
        entry = self._entry(component)
        tmp = entry.with_name(entry.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        files = {}
        for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != MARKER):
            _link_or_copy(path, tmp / path.name)
            files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
        (tmp / MANIFEST).write_text(json.dumps({"files": files, "summary": summary}))
        shutil.rmtree(entry, ignore_errors=True)
        tmp.rename(entry)

    def load(self, component: str, dest: Path) -> dict[str, Any] | None:
        """Link a verified entry's files into ``dest``; the stored summary, or None (absent or damaged)."""
        entry = self._entry(component)
        manifest = entry / MANIFEST
        if not manifest.is_file():
            return None
        data = json.loads(manifest.read_text())
        for name, meta in data["files"].items():
            path = entry / name
            if not path.is_file() or path.stat().st_size != meta["size"] or _sha256(path) != meta["sha256"]:
                log.warning("cached %s is damaged (%s); quantizing it again", component or "model", name)
                shutil.rmtree(entry, ignore_errors=True)
                return None
        for name in data["files"]:
            _link_or_copy(entry / name, dest / name)
        log.info("reusing the quantized %s from an interrupted run (%s)", component or "model", entry)
        return data["summary"]

    def stored(self, components: list[str]) -> list[str]:
        """Labels of the components that have a finished entry (a re-run reuses them after checking every file)."""
        return [c or "model" for c in components if (self._entry(c) / MANIFEST).is_file()]

    def drop(self, components: list[str]) -> None:
        for component in components:
            shutil.rmtree(self._entry(component), ignore_errors=True)
