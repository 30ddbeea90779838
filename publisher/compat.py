"""The default compatibility matrix: the environments every publish measures, beside the recipe registry.

Each entry is this environment with one package replaced (a version spec, built by publisher/verify/envs.py).
The card's "Compatibility" table and every minimum version it states come only from loads run in these
environments (and this one), never from this file: an entry says why it is worth running, not what it gives.

What the entries were chosen for (measured on tiny FLUX and Llama repos made by this tool, see
docs/compatibility.md):
- the oldest versions a card could claim: diffusers 0.39.0 and transformers 5.0.0 (loaded bit-identically);
  torchao 0.18.0 wrote these tensors, so the release before it is run to show where the format starts;
- the library path's known misloads: diffusers 0.38.0 loads a quantized transformer without its torchao
  weights, with only a warning (the first use of that model then raises); torchao 0.15.0 does the same to int8
  weights;
- transformers 4.57.6, whose loader cannot read these tensors while the manual path can: it is what the
  manual path on the card is for.

Besides these fixed boundaries, the default matrix measures the newest release on the package index of torch, torchao,
the components' library (diffusers or transformers) and accelerate, looked up when the run starts (``newest``):
what a user who upgrades today gets. ``--compat latest`` asks for those alone.

To add an environment for every publish, add an entry here; for one run, pass ``--compat SPEC``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from publisher.io import keptfile

log = logging.getLogger(__name__)

INT8 = ("Int8Tensor",)  # the torchao class whose weights torchao 0.15 loads unquantized
VARIABLE = "HF_AO_PUBLISH_COMPAT"  # --compat from the environment


@dataclass(frozen=True)
class MatrixEnv:
    spec: str  # one package, pinned exactly: publisher.verify.envs.parse_spec reads it
    why: str  # shown in the log and the card
    libraries: tuple[str, ...] = ("diffusers", "transformers")  # run when a quantized component uses one of these
    tensor_classes: tuple[str, ...] | None = None  # run when a quantized layer is of one of these; None: always

    @property
    def package(self) -> str:
        return self.spec.split("==")[0]

    @property
    def version(self) -> str:
        return self.spec.split("==")[1]


DEFAULT_MATRIX: tuple[MatrixEnv, ...] = (
    MatrixEnv("torchao==0.18.0", "the torchao release that writes these tensors"),  # skipped while it is this environment's
    MatrixEnv("torchao==0.17.0", "the torchao release before the one that writes these tensors"),
    MatrixEnv("torchao==0.15.0", "known to load int8 weights unquantized on the library path, without an error",
              tensor_classes=INT8),
    MatrixEnv("diffusers==0.39.0", "the oldest diffusers whose loader reads torchao safetensors", libraries=("diffusers",)),
    MatrixEnv("diffusers==0.38.0", "known to load a quantized model without its torchao weights, with only a warning",
              libraries=("diffusers",)),
    MatrixEnv("transformers==5.0.0", "the oldest transformers whose loader reads torchao safetensors", libraries=("transformers",)),
    MatrixEnv("transformers==4.57.6", "the last transformers 4: its loader cannot read these tensors; the manual path can",
              libraries=("transformers",)),
)


def default_matrix(classes: Iterable[str] | None, libraries: set[str], installed: dict[str, str]) -> list[MatrixEnv]:
    """The entries for a repo whose quantized layers are of the torchao ``classes`` (what its configs make; None: not
    known) when the quantized components load with ``libraries``; an entry that pins a package to the version
    installed here is this environment, which is always checked, so it is left out."""
    found = set(classes or ())
    return [e for e in DEFAULT_MATRIX
            if (e.tensor_classes is None or found & set(e.tensor_classes)) and libraries & set(e.libraries)
            and installed.get(e.package) != e.version]


NEWEST_CORE = ("torch", "torchao")  # then the components' libraries, then accelerate
NEWEST_WHY = "the newest {package} release on the package index (looked up when the run started)"
LOOKUP_TIMEOUT_S = 60.0
# A newest release found is kept this long for later runs with the same pip and pip configuration (``remembered``):
# runs one after the other (several models, the suite's publishes) ask the index once, not five pip processes a run.
# A release published meanwhile joins the matrix at most this late.
NEWEST_TTL_S = 900.0
# Where pip reads its configuration (pip's own list, every platform's): a changed file is another index
_PIP_CONFIGS = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf", "~/.pip/pip.conf", "~/.config/pip/pip.conf",
                "~/Library/Application Support/pip/pip.conf", "~/AppData/Roaming/pip/pip.ini", "C:/ProgramData/pip/pip.ini")
_NEWEST_LINE = re.compile(r"^\S+ \(([^)\s]+)\)\s*$")


@dataclass(frozen=True)
class Newest:
    """The newest releases on the index for a repo's packages, and why some (or all) were not looked up."""

    versions: dict[str, str]  # package -> newest release, only those that differ from the version installed here
    current: tuple[str, ...]  # packages whose newest release is the one installed here
    skipped: str  # one line: why nothing (or not everything) was looked up; "" when all were


def newest_packages(libraries: set[str]) -> tuple[str, ...]:
    return (*NEWEST_CORE, *sorted(libraries & {"diffusers", "transformers"}), "accelerate")


def offline() -> bool:
    """The user said offline (HF_HUB_OFFLINE): no package index is asked either. (pip's own ``--no-index`` with a
    folder of wheels is a source like any other: it is asked.)"""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)  # huggingface_hub's own reading of the variable, as the rest of the run's


def newest(libraries: set[str], installed: dict[str, str], remembered: Path | None = None) -> Newest:
    """The newest release of each package (``newest_packages``) on the index pip is configured with, asked
    concurrently (``pip index versions``: the user's mirror or folder of wheels counts); offline, nothing.
    ``remembered``: a file of the answers found in the last ``NEWEST_TTL_S`` seconds, read and kept there."""
    packages = newest_packages(libraries)
    if offline():
        return Newest({}, (), "the newest releases were not looked up: offline (HF_HUB_OFFLINE is set)")
    found, failed = _look_up(packages, remembered)
    found = {p: v.split("+")[0] for p, v in found.items()}  # a local build tag (2.15.0+cpu) is a build, not a release
    versions = {p: v for p, v in found.items() if installed.get(p, "").split("+")[0] != v}
    same = tuple(p for p in found if p not in versions)
    skipped = ""
    if failed:
        skipped = (f"the newest release of {', '.join(failed)} was not looked up: {next(iter(failed.values()))}")
    return Newest(versions, same, skipped)


@functools.lru_cache(maxsize=8)
def _look_up(packages: tuple[str, ...], remembered: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """package -> newest release, and package -> why it could not be looked up (once per run; what ``remembered``
    holds younger than ``NEWEST_TTL_S`` for this pip and its configuration is not asked again)."""
    keys = {p: _source_key(p) for p in packages}
    kept = keptfile.read(remembered, NEWEST_TTL_S) if remembered is not None else {}
    found = {p: v for p, k in keys.items() if isinstance(v := kept.get(k, {}).get("version"), str)}
    if found:
        log.info("compatibility matrix: the newest release of %s as the package index gave it in the last %.0f min",
                 ", ".join(found), NEWEST_TTL_S / 60)
    asked, failed = _ask_index([p for p in packages if p not in found])
    if remembered is not None and asked:
        keptfile.keep(remembered, {keys[p]: {"version": v} for p, v in asked.items()}, NEWEST_TTL_S)
    found.update(asked)
    return {p: found[p] for p in packages if p in found}, failed


def _ask_index(packages: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    cmd = [sys.executable, "-m", "pip", "index", "versions", "--disable-pip-version-check", "--no-input",
           "--retries", "1", "--timeout", "15"]
    env = {**os.environ, "PIP_NO_INPUT": "1"}
    procs = {p: subprocess.Popen([*cmd, p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for p in packages}
    found: dict[str, str] = {}
    failed: dict[str, str] = {}
    for package, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=LOOKUP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failed[package] = f"the package index did not answer within {LOOKUP_TIMEOUT_S:.0f} s"
            continue
        match = next((m for line in out.splitlines() if (m := _NEWEST_LINE.match(line.strip()))), None)
        if proc.returncode == 0 and match:
            found[package] = match.group(1)
        else:
            errors = [line.removeprefix("ERROR: ").strip() for line in err.splitlines() if line.startswith("ERROR:")]
            failed[package] = (errors[-1] if errors else f"pip index versions exited {proc.returncode}")[:200]
    return found, failed


def _source_key(package: str) -> str:
    """What pip's answer for ``package`` depends on: the interpreter (its pip), the PIP_* variables and every pip
    configuration file's contents (an index, a mirror, a folder of wheels)."""
    configs = [os.environ.get("PIP_CONFIG_FILE") or "", *_PIP_CONFIGS, str(Path(sys.prefix) / "pip.conf"),
               *(str(Path(d) / "pip" / "pip.conf") for d in os.environ.get("XDG_CONFIG_DIRS", "").split(os.pathsep) if d)]
    contents = []
    for name in configs:
        path = Path(name).expanduser()
        try:
            contents.append([str(path), path.read_text(encoding="utf-8", errors="replace") if name else None])
        except OSError:  # absent (most of them), or unreadable: pip reads nothing there either
            contents.append([str(path), None])
    what = [sys.executable, package, sorted((k, v) for k, v in os.environ.items() if k.startswith("PIP_")), contents]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()


def most_environments() -> int:
    """The most environments the default matrix runs with the versions installed here (int8 weights, diffusers and
    transformers components): what the help text and verify's first line state, read from the table above."""
    import importlib.metadata as md

    installed = {}
    for name in ("torchao", "diffusers", "transformers"):
        try:
            installed[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return len(default_matrix(INT8, {"diffusers", "transformers"}, installed))


def cost_text() -> str:
    """What the default matrix does and costs, in the words of the --compat help and verify's first line."""
    return (f"the default matrix has up to {most_environments()} environments, each this one with one torchao, diffusers "
            "or transformers release replaced, and one for each newest release of torch, torchao, diffusers or "
            "transformers and accelerate on the package index (looked up at the start); each built once from the package "
            "index (seconds to a minute; a torch, its CPU build, a few hundred MB) and cached, then two fresh-process "
            "reloads of every quantized component in each: minutes even for a tiny model")


def matrix_plan(target: str, values: tuple[str, ...], verify_envs: tuple[str, ...]) -> str:
    """verify's first progress line: what it will run, what that costs, and how to skip the costly part."""
    gating = f" and in {len(verify_envs)} --verify-env environment(s), which must pass" if verify_envs else ""
    specs = [v for v in values if v not in ("default", "none", "latest")]
    if "none" in values:
        matrix = "no compatibility matrix (--compat none)"
    else:
        default = (not specs and "latest" not in values) or "default" in values
        parts = [cost_text().replace("the default matrix has", "the default compatibility matrix:")] if default else []
        parts += ["the newest releases on the package index (--compat latest)"] if "latest" in values and not default else []
        parts += [f"{len(specs)} --compat environment(s), built and reloaded the same way"] if specs else []
        matrix = "; and ".join(parts) + " (--compat none skips it)"
    return f"verifying {target}: every load path in this environment{gating}; then {matrix}"

