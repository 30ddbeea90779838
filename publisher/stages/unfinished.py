"""Unfinished runs, in one place: what is marked as ours, what resumes, what is finished, what is removed.

- **Unfinished folders.** A recipe's repo folder is built under a ``.partial`` name. The moment it is created it
  gets a marker file (``handoffs.artifacts.MARKER``) holding the run's fingerprint (publisher.state.state_for) and
  recipe; ``finalize`` removes the marker before the folder takes its final name, so it is never published. A later
  run clears a ``*.partial`` folder only when it is a real folder (not a link) whose marker is a regular file that
  parses as ours; any fingerprint counts, since such a folder only ever holds files a run can make again (a re-run
  with other options must not be blocked by the leftovers of the first). A ``*.partial`` folder without the marker
  is the user's: ``--output-dir`` is then not empty, and nothing is deleted.
- **The resume cache.** Finished quantized components, keyed by everything that decides their bytes. A component
  folder is entered only when complete: its files are hard-linked (no extra disk) into a temporary entry, a
  manifest with every file's size and sha256 is written, and the entry is renamed into place. A later run with the
  same key re-checks the manifest before reusing anything, so a partial or corrupted file is never taken as
  finished. Entries are dropped once their repo is published.
- **An interrupted run.** SIGINT / SIGTERM (publisher.runtime.signals) unwind the run: the stages' own cleanup removes their
  temporary folders, kills the worker process groups and deletes a repo the run created; ``discard_unfinished``
  then removes the output the run had not finished, and ``kept_for_resume`` says what stays (the downloads in the
  Hugging Face cache, finished components in the resume cache) for the one-line message.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher.errors import Interrupted, TargetError
from publisher.handoffs.artifacts import MARKER
from publisher.io.integrity import sha256_file

if TYPE_CHECKING:
    from publisher.handoffs.artifacts import Artifacts
    from publisher.handoffs.plan import Plan
    from publisher.handoffs.report import VerifyReport
    from publisher.recipes import Recipe

log = logging.getLogger(__name__)


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
        log.info("removing %s, left by an earlier run that did not finish (interrupted or failed; %s)", p,
                 (marker_of(p) or {}).get("recipe"))
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


def prepare_output(output_dir: Path, recipe: Recipe, several: bool) -> Path:
    """The final folder for a recipe; refuses a non-empty folder we did not create."""
    folder = output_dir / recipe.name if several else output_dir
    if folder.exists() and any(p for p in folder.iterdir() if p.name != PARTIAL_NAME):
        raise TargetError(f"output folder {folder} is not empty; choose an empty or new --output-dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe = output_dir / f".{recipe.name}.write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise TargetError(f"output folder {output_dir} is not writable ({exc.strerror}); pass a writable --output-dir") from None
    return folder


PARTIAL_NAME = ".hf-ao-publish.partial"


def partial_folder(folder: Path, output_dir: Path) -> Path:
    """Where a recipe's repo is built: inside --output-dir (same filesystem, so the final move is a
    rename), under a name that is never taken for a finished folder."""
    return output_dir / PARTIAL_NAME if folder == output_dir else folder.with_name(folder.name + ".partial")


def finalize(artifacts: Artifacts, folder: Path) -> None:
    """Give the finished repo folder its final name: the last local step, after verify and the card,
    so a killed run never leaves something that looks finished."""
    partial = artifacts.folder
    (partial / MARKER).unlink(missing_ok=True)  # ours until now; never part of the repo
    if partial.parent == folder:  # built inside the output folder: move the entries up, README.md last
        entries = sorted(partial.iterdir(), key=lambda p: p.name == "README.md")
        for entry in entries:
            os.replace(entry, folder / entry.name)
        partial.rmdir()
    else:
        if folder.exists():
            folder.rmdir()
        partial.rename(folder)
    artifacts.folder = folder


def finish(artifacts: Artifacts, report: VerifyReport, folder: Path) -> None:
    """``finalize``, then the verification report written into the finished folder."""
    finalize(artifacts, folder)
    report.location = "."  # the repo folder itself: a machine's path would be published (and vary)
    report.write(artifacts.folder)


MANIFEST = "hf-ao-publish-cache.json"


def default_root() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("HF_AO_PUBLISH_CACHE") or Path(constants.HF_HOME) / "hf-ao-publish" / "components")


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
            files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
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
            if not path.is_file() or path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
                log.warning("cached %s is damaged (%s); quantizing it again", component or "model", name)
                shutil.rmtree(entry, ignore_errors=True)
                return None
        for name in data["files"]:
            _link_or_copy(entry / name, dest / name)
        log.info("reusing the quantized %s from an earlier run that did not finish (%s)", component or "model", entry)
        return data["summary"]

    def stored(self, components: list[str]) -> list[str]:
        """Labels of the components that have a finished entry (a re-run reuses them after checking every file)."""
        return [c or "model" for c in components if (self._entry(c) / MANIFEST).is_file()]

    def drop(self, components: list[str]) -> None:
        for component in components:
            shutil.rmtree(self._entry(component), ignore_errors=True)


def kept_for_resume(plan: Plan, fingerprints: list[str]) -> list[str]:
    """What an interrupted run keeps for a re-run: the base files downloaded so far (Hub bases), and the quantized
    components finished under one of ``fingerprints`` (the recipes' states) in the resume cache."""
    from huggingface_hub import constants

    kept = []
    if plan.source.repo_id:
        kept.append(f"the base files downloaded so far, in the Hugging Face cache ({constants.HF_HUB_CACHE})")
    names = [c.name for c in plan.quantized]
    stored = sorted({label for fp in fingerprints for label in ComponentCache(default_root(), fp).stored(names)})
    if stored:
        kept.append(f"the quantized {', '.join(stored)} in the resume cache ({default_root()})")
    return kept


def discard_unfinished(out_root: Path, finals: Iterable[Path], *, auto_dir: bool, existed: bool,
                       exc: BaseException) -> None:
    """Remove what the run made and did not finish: its .partial folders, its own temporary output folder, an output
    folder it created. A folder already finished and verified stays, and is named in ``exc.left``."""
    if auto_dir:  # a temporary folder of ours whose name the user never saw
        shutil.rmtree(out_root, ignore_errors=True)
        return
    for folder in finals:
        shutil.rmtree(partial_folder(folder, out_root), ignore_errors=True)
        if (folder / "README.md").is_file():  # finalize() moves the card in last: a finished, verified folder
            if isinstance(exc, Interrupted):
                exc.left.append(f"the verified folder {folder}")
        elif folder == out_root:  # --output-dir was empty (or held only our leftovers) when the run began
            for entry in list(folder.iterdir()) if folder.is_dir() else []:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
    if not existed and out_root.is_dir() and not any(out_root.iterdir()):
        out_root.rmdir()
