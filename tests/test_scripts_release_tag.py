"""scripts/release_tag.py, which .github/workflows/release.yml runs on each push to main: it prints the tag to create
(a dated changelog section for pyproject's version, no such tag yet) or nothing, against temporary git repos."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "release_tag.py"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.com", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **GIT_ENV}).stdout


def _repo(tmp_path: Path, version: str = "0.2.0", package: str | None = None, heading: str = "## 0.2.0 - 2026-12-04") -> Path:
    """A repo with the three files the script reads, committed on main with the release tag of 0.1.0."""
    repo = tmp_path / "repo"
    (repo / "publisher").mkdir(parents=True)
    (repo / "pyproject.toml").write_text(f'[project]\nname = "hf-ao-publish"\nversion = "{version}"\n')
    (repo / "publisher" / "__init__.py").write_text(f'"""The package."""\n\n__version__ = "{package or version}"\n')
    (repo / "CHANGELOG.md").write_text(f"# Changelog\n\n{heading}\n\n- a change\n\n## 0.1.0 - 2026-11-01\n\n- the first\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "release")
    _git(repo, "tag", "-a", "v0.1.0", "-m", "hf-ao-publish 0.1.0")
    return repo


def _run(repo: Path) -> subprocess.CompletedProcess[str]:
    """As the workflow runs it: from the checkout, under the runner's python3, nothing installed."""
    return subprocess.run([sys.executable, "-I", str(SCRIPT)], cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **GIT_ENV})


def test_a_dated_section_without_its_tag_is_a_release(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    proc = _run(repo)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "v0.2.0\n", "")
    _git(repo, "tag", "-a", "v0.2.0", "-m", "hf-ao-publish 0.2.0")  # what the workflow does next
    again = _run(repo)
    assert (again.returncode, again.stdout) == (0, "")  # a tag that exists is never made again


@pytest.mark.parametrize("heading", ["## 0.2.0 (not tagged yet)", "## 0.2.0", "## 0.1.9 - 2026-12-04"])
def test_an_undated_section_is_no_release(tmp_path: Path, heading: str) -> None:
    proc = _run(_repo(tmp_path, heading=heading))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_an_old_version_already_tagged_is_no_release(tmp_path: Path) -> None:
    proc = _run(_repo(tmp_path, version="0.1.0", heading="## 0.2.0 (not tagged yet)"))
    assert (proc.returncode, proc.stdout) == (0, "")


def test_versions_that_disagree_fail(tmp_path: Path) -> None:
    proc = _run(_repo(tmp_path, package="0.1.9"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == ("Error: pyproject.toml's version 0.2.0 and publisher/__init__.py's __version__ 0.1.9 disagree; "
                           "set both to the release's version\n")


def test_a_date_that_is_not_a_date_fails(tmp_path: Path) -> None:
    proc = _run(_repo(tmp_path, heading="## 0.2.0 - 2026-13-04"))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == "Error: CHANGELOG.md: the 0.2.0 section's date '2026-13-04' is not YYYY-MM-DD\n"


def test_outside_a_git_checkout_it_says_so(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    shutil.rmtree(repo / ".git")
    proc = _run(repo)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"Error: {repo} is not a git checkout (") and "run it in the repository" in proc.stderr


def test_this_checkout() -> None:
    """What the workflow decides for this checkout: the version's tag when its section is dated and the checkout has no
    such tag yet (a clone without tags, as the test machines' worktrees are, has none), else nothing."""
    from publisher import __version__

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist): the workflow runs the script in one")
    proc = subprocess.run([sys.executable, "-I", str(SCRIPT), str(ROOT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    dated = f"\n## {__version__} - " in (ROOT / "CHANGELOG.md").read_text()
    tagged = _git(ROOT, "tag", "--list", f"v{__version__}").strip() == f"v{__version__}"
    assert proc.stdout == (f"v{__version__}\n" if dated and not tagged else "")
