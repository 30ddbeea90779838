"""The install step: a venv in $RUNNER_TEMP with the pinned torch build, then the action's own copy of the tool.

torch goes first, from the index of the chosen build: PyPI's torch==2.13.0 is the multi-GB CUDA build, which
a CPU runner does not want. The tool comes from $GITHUB_ACTION_PATH, the checkout of the action at the ref the
workflow asked for, so the action and the CLI it runs are always the same version.

This step runs under whatever python3 the runner has (python-version '' skips actions/setup-python), so it
checks the version itself and says which input fixes it.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from action.inputs import ActionInputError
from action.workflow import StepFailed, group, write_output

TORCH_VERSION = "2.13.0"  # the torch of constraints.txt (a test keeps them equal)
TORCH_INDEX = "https://download.pytorch.org/whl/"
MIN_PYTHON = (3, 11)  # pyproject's requires-python


def torch_index(build: str | None) -> str:
    """pip --index-url for a torch build: cpu, cuXYZ (e.g. cu128), rocmX.Y; 'pypi' -> '' (PyPI's default).

    The value becomes part of a URL, so only these shapes are accepted."""
    name = (build or "cpu").strip().lower()
    if name == "pypi":
        return ""
    if name == "cpu" or re.fullmatch(r"cu\d{3}", name) or re.fullmatch(r"rocm\d+(\.\d+)+", name):
        return TORCH_INDEX + name
    raise ActionInputError(f"input torch-build must be cpu, cuXYZ (e.g. cu126, cu128), rocmX.Y or pypi, got {build!r}")


def action_path(env: Mapping[str, str]) -> Path:
    """The action's checkout: $GITHUB_ACTION_PATH on a runner, else the repo this file is in (tests)."""
    return Path(env.get("GITHUB_ACTION_PATH") or Path(__file__).resolve().parent.parent)


def package_version(root: Path) -> str:
    """The tool's version in the checkout, read from the source: the package is not importable here."""
    text = (root / "publisher" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)', text, re.MULTILINE)
    if not match:  # pragma: no cover - the package always defines it
        raise StepFailed(f"cannot read the package version from {root}")
    return match.group(1)


def installed_versions(python: str) -> dict[str, str] | None:
    """torch and hf-ao-publish versions in an interpreter, or None when either is missing."""
    code = ("import importlib.metadata as m, json\n"
            "print(json.dumps({'torch': m.version('torch'), 'hf-ao-publish': m.version('hf-ao-publish')}))")
    try:
        proc = subprocess.run([python, "-I", "-c", code], check=False, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return {str(key): str(value) for key, value in found.items()} if isinstance(found, dict) else None


def versions_match(versions: Mapping[str, str] | None, version: str) -> bool:
    """The pinned torch (any local build tag: +cpu, +cu128) and this checkout's version of the tool."""
    if not versions:
        return False
    return versions.get("torch", "").split("+")[0] == TORCH_VERSION and versions.get("hf-ao-publish") == version


def _use_existing(env: Mapping[str, str], version: str) -> str:
    # HF_AO_PUBLISH_SKIP_INSTALL: a runner image (or the tests) that already has both installed.
    python = env.get("HF_AO_PUBLISH_PYTHON") or sys.executable
    found = installed_versions(python)
    if found is None or not versions_match(found, version):
        raise ActionInputError(f"HF_AO_PUBLISH_SKIP_INSTALL is set but {python} does not have torch {TORCH_VERSION} and "
                         f"hf-ao-publish {version} (found {found}); unset it to let the action install them")
    print(f"HF_AO_PUBLISH_SKIP_INSTALL: using {python} (torch {found['torch']}, hf-ao-publish {version})")
    return python


def _create_venv(venv: Path, build: str, index: str, root: Path, version: str) -> None:
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off"]
    torch = pip + [f"torch=={TORCH_VERSION}"] + (["--index-url", index] if index else [])
    with group(f"Install torch {TORCH_VERSION} ({build}) and hf-ao-publish {version}"):
        # the tool with the exact set its tests ran with (constraints.txt); pyproject.toml only states ranges
        for cmd in ([sys.executable, "-m", "venv", str(venv)], torch, pip + [str(root), "-c", str(root / "constraints.txt")]):
            print("+ " + shlex.join(cmd), flush=True)
            if subprocess.run(cmd, check=False).returncode != 0:
                raise StepFailed(f"installation failed: {shlex.join(cmd)} (see the log above)")


def install(env: Mapping[str, str]) -> int:
    """Install (or reuse) the tool; write the interpreter that has it as the step output `python`."""
    root = action_path(env)
    version = package_version(root)
    if env.get("HF_AO_PUBLISH_SKIP_INSTALL", "").strip().lower() in ("1", "true", "yes"):
        write_output(env.get("GITHUB_OUTPUT"), "python", _use_existing(env, version))
        return 0
    index = torch_index(env.get("HFAO_TORCH_BUILD"))
    if sys.version_info < MIN_PYTHON:
        raise ActionInputError(f"hf-ao-publish needs Python >= 3.11, this is {sys.version.split()[0]}; "
                         "set the python-version input (e.g. '3.11')")
    venv = Path(env.get("RUNNER_TEMP") or tempfile.gettempdir()) / "hf-ao-publish-venv"
    python = str(venv / "bin" / "python")
    # A second use of the action in the same job reuses the venv when it holds the same versions.
    if (venv / "bin" / "python").exists() and versions_match(installed_versions(python), version):
        print(f"reusing {venv} (torch {TORCH_VERSION}, hf-ao-publish {version})")
    else:
        build = (env.get("HFAO_TORCH_BUILD") or "cpu").strip().lower()
        _create_venv(venv, build, index, root, version)
    write_output(env.get("GITHUB_OUTPUT"), "python", python)
    return 0
