"""Ship this very code to a Job: a wheel of the running `publisher` package, uploaded to a private Hub repo.

The wheel holds the files of the package that is running (a source checkout or an installed copy, edits
included), the card template, and the dependency pins of this project, so the job runs the same code with
the same library versions as the machine that submitted it. Its version is this tool's plus a local label
made of the content digest (``0.1.0+<12 hex>``), so pip never mistakes it for another build.

The wheel is built byte for byte reproducibly (sorted entries, fixed timestamps): the same code gives the same
file name and sha256, and a re-run finds it already uploaded. It goes to the private dataset repo
``<user>/hf-ao-publish-jobs``, one file per code version; the job downloads it at the pinned commit with the
token it receives as a secret and checks the sha256 (bootstrap.py).
"""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from publisher import __version__
from publisher.errors import PublishError
from publisher.io import hub

log = logging.getLogger(__name__)

DIST_NAME = "hf-ao-publish"
REPO_NAME = "hf-ao-publish-jobs"
REPO_TYPE = "dataset"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: the same bytes whenever the wheel is built
_README = """---
viewer: false
---
# hf-ao-publish wheels for Hugging Face Jobs

`hf-ao-publish MODEL --quant RECIPE --on-hf-jobs FLAVOR` uploads here a wheel of the exact code that submitted
the job (one file per code version, named by its content digest), and the job installs it from the pinned
commit. Nothing else is stored here; old wheels can be deleted at any time.
"""


@dataclass(frozen=True)
class Wheel:
    filename: str
    data: bytes
    sha256: str
    version: str


@dataclass(frozen=True)
class ShippedWheel:
    """Where a job finds the wheel: the URL path under the Hub endpoint, at a commit, and its digest."""

    repo_id: str
    revision: str
    filename: str
    sha256: str
    version: str

    @property
    def path(self) -> str:
        return f"datasets/{self.repo_id}/resolve/{self.revision}/{self.filename}"


@dataclass(frozen=True)
class _Project:
    requires_python: str
    dependencies: tuple[str, ...]
    scripts: tuple[tuple[str, str], ...]


def _project(package: Path) -> _Project:
    """Dependencies and console scripts: pyproject.toml of a source checkout, else the installed metadata."""
    pyproject = package.parent / "pyproject.toml"
    if pyproject.is_file():
        data = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if data.get("name") == DIST_NAME:
            return _Project(str(data.get("requires-python", "")), tuple(data.get("dependencies", ())),
                            tuple(sorted(data.get("scripts", {}).items())))
    import importlib.metadata as md

    try:
        dist = md.distribution(DIST_NAME)
    except md.PackageNotFoundError:
        raise PublishError(f"cannot find the metadata of {DIST_NAME} to ship it to a Job; install it with pip "
                           "(pip install .) or run it from a source checkout") from None
    requires = tuple(r for r in (dist.requires or []) if "extra ==" not in r)
    scripts = tuple(sorted((ep.name, ep.value) for ep in dist.entry_points if ep.group == "console_scripts"))
    return _Project(dist.metadata["Requires-Python"] or "", requires, scripts)


CONSTRAINTS = "constraints.txt"  # the exact set the tests ran with: at the checkout's root, or in the installed package


def constraints(package: Path | None = None) -> list[str]:
    """The lines of constraints.txt but torch's (the job installs the torch of its flavor first), for the bootstrap's
    ``pip install -c``; empty when this installation has none (then pip resolves within the wheel's ranges)."""
    import publisher

    package = package or Path(publisher.__file__).resolve().parent
    for path in (package / CONSTRAINTS, package.parent / CONSTRAINTS):
        if path.is_file():
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
            return [line for line in lines if line and not line.startswith("#") and not line.startswith("torch==")]
    log.warning("no %s in this installation: the job installs the newest releases the package's ranges allow", CONSTRAINTS)
    return []


def _package_files(package: Path) -> list[tuple[str, bytes]]:
    files = []
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if path.is_dir() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo"):
            continue
        files.append((f"publisher/{rel.as_posix()}", path.read_bytes()))
    if not (package / "templates").is_dir():  # a source checkout: the template sits at the repo root
        templates = package.parent / "templates"
        for path in sorted(templates.rglob("*")) if templates.is_dir() else []:
            if path.is_file():
                files.append((f"publisher/templates/{path.relative_to(templates).as_posix()}", path.read_bytes()))
    if not (package / CONSTRAINTS).is_file() and (package.parent / CONSTRAINTS).is_file():  # a checkout: at its root
        files.append((f"publisher/{CONSTRAINTS}", (package.parent / CONSTRAINTS).read_bytes()))
    if not any(name.startswith("publisher/templates/") for name, _ in files):
        raise PublishError("the card template is missing from this installation; reinstall hf-ao-publish")
    return files


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(package: Path | None = None) -> Wheel:
    """A py3-none-any wheel of the package at ``package`` (default: the running one)."""
    import publisher

    package = package or Path(publisher.__file__).resolve().parent
    project = _project(package)
    files = _package_files(package)
    digest = hashlib.sha256()
    for name, data in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    digest.update("\n".join(project.dependencies).encode())
    version = f"{__version__}+{digest.hexdigest()[:12]}"
    dist_info = f"hf_ao_publish-{version}.dist-info"
    metadata = "\n".join(["Metadata-Version: 2.1", f"Name: {DIST_NAME}", f"Version: {version}",
                          *( [f"Requires-Python: {project.requires_python}"] if project.requires_python else []),
                          *(f"Requires-Dist: {req}" for req in project.dependencies), ""])
    entry_points = "[console_scripts]\n" + "".join(f"{name} = {value}\n" for name, value in project.scripts)
    wheel_meta = "Wheel-Version: 1.0\nGenerator: hf-ao-publish\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files += [(f"{dist_info}/METADATA", metadata.encode()), (f"{dist_info}/WHEEL", wheel_meta.encode()),
              (f"{dist_info}/entry_points.txt", entry_points.encode())]
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files) + f"{dist_info}/RECORD,,\n"
    files.append((f"{dist_info}/RECORD", record.encode()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    data = buffer.getvalue()
    filename = f"hf_ao_publish-{version}-py3-none-any.whl"
    return Wheel(filename, data, hashlib.sha256(data).hexdigest(), version)


def ship(namespace: str, token: str) -> ShippedWheel:
    """Upload the running code's wheel to <namespace>/hf-ao-publish-jobs (once per code version); returns
    where the job downloads it, pinned to a commit."""
    from huggingface_hub import CommitOperationAdd

    wheel = build_wheel()
    repo_id = f"{namespace}/{REPO_NAME}"
    api = hub.client(token)
    hub.call(api.create_repo, repo_id, repo_type=REPO_TYPE, private=True, exist_ok=True,
             what=f"creating the private repo {repo_id} for the job's wheel")
    info = hub.call(api.dataset_info, repo_id, files_metadata=False, what=f"reading {repo_id}")
    present = {s.rfilename for s in (info.siblings or [])}
    if wheel.filename in present:
        log.info("this code's wheel is already on the Hub: %s/%s", repo_id, wheel.filename)
        return ShippedWheel(repo_id, str(info.sha), wheel.filename, wheel.sha256, wheel.version)
    operations = [CommitOperationAdd(path_in_repo=wheel.filename, path_or_fileobj=wheel.data)]
    if "README.md" not in present:
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=_README.encode()))
    log.info("uploading this code as %s to the private repo %s", wheel.filename, repo_id)
    commit = hub.call(api.create_commit, repo_id, operations=operations, repo_type=REPO_TYPE,
                      commit_message=f"hf-ao-publish {wheel.version} for Hugging Face Jobs",
                      what=f"uploading the job's wheel to {repo_id}")
    return ShippedWheel(repo_id, str(commit.oid), wheel.filename, wheel.sha256, wheel.version)
