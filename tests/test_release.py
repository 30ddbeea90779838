"""The release's versions agree (docs/development.md#releases): pyproject.toml, the package, the changelog's sections,
and every place the docs name the project on GitHub: `uses: <owner>/hf-ao-publish@vX.Y.Z` pins, the cache key written
the same way, `hf extensions install <owner>/hf-ao-publish` and github.com URLs all name the owner of pyproject.toml's
`Repository` URL and a release the release workflow tags (a version whose changelog section is dated)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from publisher import __version__

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = {"vX.Y.Z", "v..."}  # the release process's own text (development.md, the changelog's head)
SECTION = re.compile(r"^## (\S+)(?: - (\d{4}-\d{2}-\d{2}))?", re.MULTILINE)


def _sections() -> list[tuple[str, str | None]]:
    """(version, date or None) of each changelog section, newest first."""
    return [(v, d or None) for v, d in SECTION.findall((ROOT / "CHANGELOG.md").read_text())]


def _released() -> str:
    """The newest version whose section is dated: the newest tag the release workflow makes."""
    dated = [v for v, d in _sections() if d]
    assert dated, "CHANGELOG.md has no dated section (`## X.Y.Z - YYYY-MM-DD`): no release the docs could pin"
    return dated[0]


def _owner() -> str:
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/hf-ao-publish", PROJECT["urls"]["Repository"])
    assert m, f"pyproject.toml [project.urls] Repository is not the GitHub repo hf-ao-publish: {PROJECT['urls']}"
    return m.group(1)


def test_the_package_has_the_version_of_pyproject() -> None:
    assert PROJECT["version"] == __version__


def test_the_changelog_has_a_section_for_the_version() -> None:
    sections = _sections()
    assert sections and sections[0][0] == __version__, sections  # the newest section is this version's
    # the version is the newest release, or the next one, still undated, above it
    assert _released() == __version__ or sections[0][1] is None, sections


def test_every_pin_in_the_docs_names_the_owner_and_a_tagged_release() -> None:
    owner, tag = _owner(), f"v{_released()}"
    uses, refs, installs, urls = set(), set(), set(), set()
    for path in DOCS:
        text = path.read_text()
        uses |= {(path.name, o) for o in re.findall(r"uses:\s*([\w.-]+)/hf-ao-publish@", text)}
        # every ref: the pins, and the cache key written the same way
        refs |= {(path.name, ref) for ref in re.findall(r"hf-ao-publish@([\w.]+)", text) if ref not in PLACEHOLDERS}
        installs |= {(path.name, o) for o in re.findall(r"hf extensions install ([\w.-]+)/hf-ao-publish\b", text)}
        urls |= {(path.name, o) for o in re.findall(r"github\.com/([\w.-]+)/hf-ao-publish\b", text)}
    assert any(name == "action.md" for name, _ in uses), "docs/action.md shows no `uses: <owner>/hf-ao-publish@vX.Y.Z`"
    assert any(name == "hf-jobs.md" for name, _ in installs), "docs/hf-jobs.md shows no `hf extensions install`"
    assert uses | installs | urls <= {(p.name, owner) for p in DOCS}, (uses, installs, urls)
    assert {ref for _, ref in refs} == {tag}, refs
