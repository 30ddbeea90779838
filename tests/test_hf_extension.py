"""`hf ao-publish`: the project as an `hf` CLI extension.

huggingface_hub's convention (huggingface_hub/cli/extensions.py): `hf extensions install OWNER/hf-<name>`
pip-installs the GitHub repo `hf-<name>` into its own venv (unless the repo has an executable file named
`hf-<name>` at its root, which makes it a "binary" extension) and records the venv's console script
`hf-<name>` in ~/.local/share/hf/extensions/hf-<name>/manifest.json; `hf <name> ARGS` then runs that script.
Here the manifest is written by the test (no GitHub) and points at this project's console script; the real
`hf` dispatches to it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from publisher import __version__

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NAME = "ao-publish"  # `hf ao-publish`: repository hf-ao-publish, console script hf-ao-publish
# the GitHub owner `hf extensions install OWNER/hf-ao-publish` names (docs/hf-jobs.md): pyproject.toml's Repository
OWNER = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"].split("/")[-2]


def test_the_project_follows_the_extension_convention() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"][f"hf-{NAME}"] == "publisher.cli:main"
    # a file named like the script at the repo root would be installed as a shell-script extension instead
    assert not (ROOT / f"hf-{NAME}").exists()
    # `hf extensions list` shows the description, read from the first `description =` line of pyproject.toml
    first = next(line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.strip().startswith("description"))
    assert first.partition("=")[2].strip().strip("\"'") == project["description"]


def _hf(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HOME": str(home), "HF_HUB_DISABLE_UPDATE_CHECK": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([str(BIN / "hf"), *args], capture_output=True, text=True, env=env, timeout=300, cwd=home)


@pytest.mark.slow
def test_hf_dispatches_to_our_console_script(tmp_path: Path) -> None:
    script = BIN / f"hf-{NAME}"
    assert (BIN / "hf").is_file() and script.is_file(), "huggingface_hub's hf and our console script are installed"
    folder = tmp_path / ".local" / "share" / "hf" / "extensions" / f"hf-{NAME}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({
        "owner": OWNER, "repo": f"hf-{NAME}", "repo_id": f"{OWNER}/hf-{NAME}", "short_name": NAME,
        "executable_path": str(script), "type": "python", "installed_at": "2026-01-01T00:00:00+00:00",
        "description": "Quantize a Hugging Face model with torchao and publish it", "commit_sha": None,
    }))
    version = _hf(tmp_path, NAME, "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout == f"hf-ao-publish, version {__version__}\n"
    recipes = _hf(tmp_path, NAME, "recipes")
    assert recipes.returncode == 0 and "int4wo" in recipes.stdout and "hf jobs" in recipes.stdout
    missing = _hf(tmp_path, NAME, "publish")  # our exit code and message come back through hf
    assert missing.returncode == 2 and "Missing argument 'MODEL_ID...'" in missing.stderr
    listing = _hf(tmp_path, "--help")
    assert listing.returncode == 0 and NAME in listing.stdout and f"[extension {OWNER}/hf-ao-publish]" in listing.stdout
