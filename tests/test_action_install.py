"""action/install.py: the torch index of a build, the pin, and the version check of an existing interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from action.inputs import ActionInputError
from action.install import (
    TORCH_VERSION,
    installed_versions,
    package_version,
    torch_index,
    versions_match,
)

ROOT = Path(__file__).resolve().parent.parent


def test_torch_index() -> None:
    assert torch_index("cpu") == "https://download.pytorch.org/whl/cpu"
    assert torch_index("") == "https://download.pytorch.org/whl/cpu"
    assert torch_index("CU128") == "https://download.pytorch.org/whl/cu128"
    assert torch_index("rocm6.4") == "https://download.pytorch.org/whl/rocm6.4"
    assert torch_index("pypi") == ""
    for bad in ("cuda", "cu12.8", "cpu; rm -rf /", "https://evil.example/simple"):
        with pytest.raises(ActionInputError, match="torch-build"):
            torch_index(bad)
    # script mode, as the install step runs it (no package import, isolated interpreter)
    proc = subprocess.run([sys.executable, "-I", str(ROOT / "action" / "main.py"), "torch-index", "cu126"],
                          capture_output=True, text=True, cwd="/")
    assert proc.stdout.strip() == "https://download.pytorch.org/whl/cu126", proc.stderr


def test_torch_pin_matches_the_constraints() -> None:
    text = (ROOT / "constraints.txt").read_text()
    assert f"\ntorch=={TORCH_VERSION}\n" in text


def test_versions_match() -> None:
    version = package_version(ROOT)
    assert f'__version__ = "{version}"' in (ROOT / "publisher" / "__init__.py").read_text()
    assert versions_match({"torch": f"{TORCH_VERSION}+cpu", "hf-ao-publish": version}, version)
    assert not versions_match({"torch": "2.0.0", "hf-ao-publish": version}, version)
    assert not versions_match({"torch": TORCH_VERSION, "hf-ao-publish": "0.0.1"}, version)
    assert not versions_match(None, version) and not versions_match({}, version)


def test_installed_versions() -> None:
    found = installed_versions(sys.executable)  # this venv has both
    assert found is not None and versions_match(found, package_version(ROOT))
    assert installed_versions("/nonexistent/python") is None
