"""What a load-path worker found in a compatibility environment, kept for the next run that asks the same question.

A compatibility measurement is deterministic: the same files, loaded along the same path by the same code in the same
environment (every package at the same version), with the same inputs and thread count, give the same classes, the
same errors and the same output bytes. So a worker's result (its JSON and its output tensor) is kept beside the
environments' cache (``envs.envs_root()/measured``, or ``$HF_AO_PUBLISH_MEASURED``), keyed by all of that, and a later run with an identical
question reads it instead of starting the environment again: a re-run whose card options changed, ``verify`` of a
folder just published, or one publish of the same bytes after another. What is compared with it is always the
current run's own expected record (``full.compare``), so a kept result can only stand for a load, never for a verdict.

Only the compatibility matrix reads this: this environment's own loads (the verification that must pass) run every
time. A key is made only when every part of it is known: a spec-built environment (its record), a local folder
(every file of the component hashed, a config's ``_name_or_path`` value aside: ``_content``) or a Hub commit (its
sha), an inputs file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from publisher.handoffs.artifacts import MARKER
from publisher.io.integrity import sha256_file
from publisher.verify.envs import RECORD, built_folder, envs_root

CONFIG = "config.json"  # a component's config: its ``_name_or_path`` value is no part of the question (``_content``)
# A repo's own report files and the unfinished folder's marker change with every run and are read by no load path
NOT_READ = frozenset({"README.md", "verification.json", "hf_ao_publish.json", ".gitattributes", "quality_grid.jpg", MARKER})


def key(request: dict[str, Any], python: str, worker: Path) -> str | None:
    """The key of one worker request (a component along a path), or None when a part of it cannot be pinned."""
    built = built_folder(python)  # a spec-built environment's record pins every package
    if built is None or not request.get("inputs"):
        return None
    where, subfolder, revision = request["location"], request.get("subfolder"), request.get("revision")
    folder = Path(where) / subfolder if subfolder else Path(where)
    if Path(where).is_dir():
        files = {p.name: _content(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name not in NOT_READ}
        source: Any = {"files": files}
    elif revision and len(revision) == 40:  # a Hub commit: content-addressed
        source = {"repo": where, "revision": revision, "subfolder": subfolder}
    else:
        return None
    question = {
        "environment": [python, (built / RECORD).read_text(encoding="utf-8")],
        "worker": sha256_file(worker),
        "source": source,
        "inputs": sha256_file(Path(request["inputs"])),
        **{k: request.get(k) for k in ("path", "library", "class_name", "subfolder", "threads", "device", "dtype")},
    }
    return hashlib.sha256(json.dumps(question, sort_keys=True).encode()).hexdigest()


def _content(path: Path) -> str:
    """A file's key: the sha256 of its bytes, but for the value of a config's ``_name_or_path`` (diffusers records
    the base's name there: the same weights published from ``bfl/tiny-flux`` and from ``./my-pipeline`` differ only
    in it), which no load reads: ``from_pretrained`` sets it again to what it loads from. Every other byte counts."""
    if path.name != CONFIG:
        return sha256_file(path)
    data = path.read_bytes()
    try:
        name = json.loads(data).get("_name_or_path")
    except (ValueError, AttributeError):  # not a JSON object: its bytes
        name = None
    if isinstance(name, str):
        data = data.replace(b'"_name_or_path": ' + json.dumps(name).encode(), b'"_name_or_path": ""', 1)
    return hashlib.sha256(data).hexdigest()


def root() -> Path:
    """Where results are kept: ``$HF_AO_PUBLISH_MEASURED``, else ``measured`` beside the environments."""
    return Path(os.environ.get("HF_AO_PUBLISH_MEASURED") or envs_root() / "measured")


def _folder(k: str) -> Path:
    return root() / k[:2] / k


def read(k: str, request: dict[str, Any]) -> dict[str, Any] | None:
    """The kept result for ``k``, its output copied to where ``request`` wants it; None when none is kept."""
    folder = _folder(k)
    try:
        data = json.loads((folder / "result.json").read_text(encoding="utf-8"))
        if data.get("output"):
            shutil.copyfile(folder / "output.safetensors", request["output"])
            data["output"] = request["output"]
    except (OSError, ValueError):  # none kept, or half of one: measure again
        return None
    data["measured_before"] = True
    return data


def write(k: str, data: dict[str, Any]) -> None:
    """Keep a worker's result (whole or not at all: written aside, then renamed into place)."""
    final = _folder(k)
    if final.exists():
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        kept = dict(data)
        if kept.get("output"):
            shutil.copyfile(kept["output"], tmp / "output.safetensors")
            kept["output"] = "output.safetensors"
        (tmp / "result.json").write_text(json.dumps(kept), encoding="utf-8")
        os.replace(tmp, final)
    except OSError:  # a full disk or a race with another run: the result is only not kept
        shutil.rmtree(tmp, ignore_errors=True)
