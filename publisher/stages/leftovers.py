"""Only our own leftovers are ever deleted.

A recipe's repo folder is built under a ``.partial`` name (stages/quantize.py). The moment it is created it
gets a marker file, ``.hf-ao-publish-partial.json``, holding the run's fingerprint (publisher.state.state_for) and recipe;
``finalize`` removes the marker before the folder takes its final name, so it is never published.

A later run clears a ``*.partial`` folder only when it is a real folder (not a link) whose marker is a regular
file that parses as ours; any fingerprint counts, since such a folder only ever holds files a run can make again
(a re-run with other options must not be blocked by the leftovers of the first). A ``*.partial`` folder without
the marker is the user's: ``--output-dir`` is then not empty, and nothing is deleted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path

from publisher.errors import TargetError

log = logging.getLogger(__name__)

MARKER = ".hf-ao-publish-partial.json"
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


def make_partial(partial: Path, fingerprint: str, recipe: str) -> None:
    """Create the unfinished folder of a recipe, marked as ours."""
    partial.mkdir(parents=True)
    marker = {"tool": "hf-ao-publish", "fingerprint": fingerprint, "recipe": recipe}
    (partial / MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")


def marker_of(folder: Path) -> dict[str, str] | None:
    """The marker of an unfinished folder of ours, or None when ``folder`` is not one (links never count)."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return None
        st = os.lstat(folder / MARKER)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return None
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("tool") != "hf-ao-publish" or not isinstance(data.get("recipe"), str):
        return None
    fingerprint = data.get("fingerprint")
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        return None
    return data


def remove_partial(partial: Path) -> None:
    """Remove an unfinished folder about to be rebuilt; refuse one that is not ours."""
    if not partial.exists() and not partial.is_symlink():
        return
    if marker_of(partial) is None:
        raise TargetError(f"{partial} is in the way and is not an unfinished folder of hf-ao-publish (it has no {MARKER}); "
                          "move it away or choose another --output-dir")
    shutil.rmtree(partial)


def clear_output_dir(path: Path) -> None:
    """``--output-dir`` must be empty, or hold only our unfinished folders (then removed); else ``TargetError``,
    before anything is deleted."""
    entries = sorted(path.iterdir())
    theirs = [p for p in entries if not (p.name.endswith(".partial") and marker_of(p) is not None)]
    if theirs:
        partial = next((p for p in theirs if p.name.endswith(".partial")), None)
        why = (f" ({partial.name} is not an unfinished folder of hf-ao-publish: it has no {MARKER}, so it is left alone)"
               if partial is not None else "")
        raise TargetError(f"--output-dir {path} is not empty{why}; choose an empty or new folder")
    for p in entries:
        log.info("removing %s, left unfinished by an interrupted run (%s)", p, (marker_of(p) or {}).get("recipe"))
        shutil.rmtree(p)


def check_output_dir(path: Path) -> None:
    """Fail before any download when the output folder cannot be used; leave nothing behind."""
    if path.exists() and not path.is_dir():
        raise TargetError(f"--output-dir {path} is a file; give a folder")
    if path.is_dir():  # only an interrupted run's marked unfinished folders are removed (below)
        clear_output_dir(path)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".hf-ao-publish-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise TargetError(f"--output-dir {path} is not writable ({exc.strerror or exc}); pass a writable folder") from None
    finally:
        if created and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
