"""The release's versions agree (docs/development.md#releases): pyproject.toml, the package, the changelog's section
and every `uses: OWNER/hf-ao-publish@v...` pin in the docs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from publisher import __version__

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_has_the_version_of_pyproject() -> None:
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_the_changelog_has_a_section_for_the_version() -> None:
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings and headings[0] == __version__, headings  # the newest section is this version's


def test_every_pin_in_the_docs_names_the_version() -> None:
    pins = {(path.name, pin) for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            for pin in re.findall(r"hf-ao-publish@(v\d[\w.]*)", path.read_text())}
    assert pins, "no pin found: the Action docs show `uses: OWNER/hf-ao-publish@vX.Y.Z`"
    assert {pin for _, pin in pins} == {f"v{__version__}"}, pins
