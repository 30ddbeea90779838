"""The release tag to create, if any: `python scripts/release_tag.py [REPO]` prints `vX.Y.Z` or nothing.

.github/workflows/release.yml runs it on every push to main and creates and pushes what it prints
(docs/development.md#releases). X.Y.Z is pyproject.toml's version; it is a release to tag when CHANGELOG.md has a
dated section for it (`## X.Y.Z - YYYY-MM-DD`) and the repo has no tag `vX.Y.Z` yet. An undated section
(`## X.Y.Z (not tagged yet)`) is work in progress: nothing is printed. Exits 1, naming both, when pyproject.toml's
version and publisher/__init__.py's __version__ disagree (the tag would name a version the package does not report),
or when the dated section's date is not a date.

Standard library only: the workflow runs it under the runner's python3 (3.11 or later, for tomllib) before anything is
installed.
"""

from __future__ import annotations

import ast
import datetime
import re
import subprocess
import sys
import tomllib
from pathlib import Path


class ReleaseError(Exception):
    """The repo's release files disagree: the message names what to fix."""


def package_version(root: Path) -> str:
    """`__version__` of publisher/__init__.py, read without importing the package (nothing is installed)."""
    tree = ast.parse((root / "publisher" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    raise ReleaseError("publisher/__init__.py sets no __version__ string")


def release_date(changelog: str, version: str) -> datetime.date | None:
    """The date of the version's section (`## X.Y.Z - YYYY-MM-DD`); None when its section is not dated."""
    m = re.search(rf"^## {re.escape(version)} - (\S+)[ \t]*$", changelog, re.MULTILINE)
    if m is None:
        return None
    try:
        return datetime.date.fromisoformat(m.group(1))
    except ValueError:
        raise ReleaseError(f"CHANGELOG.md: the {version} section's date {m.group(1)!r} is not YYYY-MM-DD") from None


def tag_exists(root: Path, tag: str) -> bool:
    found = subprocess.run(["git", "-C", str(root), "tag", "--list", tag], capture_output=True, text=True)
    if found.returncode != 0:
        raise ReleaseError(f"{root} is not a git checkout ({found.stderr.strip()}); run it in the repository")
    return found.stdout.strip() == tag


def tag_to_create(root: Path) -> str | None:
    """`vX.Y.Z` when pyproject's version has a dated changelog section and no tag yet; None otherwise."""
    version = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    package = package_version(root)
    if version != package:
        raise ReleaseError(f"pyproject.toml's version {version} and publisher/__init__.py's __version__ {package} "
                           "disagree; set both to the release's version")
    if release_date((root / "CHANGELOG.md").read_text(encoding="utf-8"), version) is None:
        return None
    tag = f"v{version}"
    return None if tag_exists(root, tag) else tag


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: release_tag.py [REPO]", file=sys.stderr)
        return 2
    try:
        tag = tag_to_create(Path(argv[0] if argv else ".").resolve())
    except ReleaseError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    if tag:
        print(tag)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
