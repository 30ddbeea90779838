"""docs/design.md's source tree is the code's: every module of the package is named under its folder, and every
module the tree names exists (so the tree cannot drift as modules are added, moved or removed)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRY = re.compile(r"^( *)([\w.]+/?)(?: {2,}|$)")  # an entry: its indent, its name (a folder ends in /)


def _tree() -> dict[str, set[str]]:
    """Folder (relative to publisher/) -> the module file names the tree mentions in it."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text.split("## The source tree", 1)[1].split("```", 2)[1]
    named: dict[str, set[str]] = {}
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    folder = None  # where the current entry (and its continuation lines) belongs
    for line in block.splitlines():
        if line.strip() and not line.startswith(" "):  # the package itself, or a path outside it (templates/, action/)
            stack, folder = ([(0, "")], None) if line.split()[0] == "publisher/" else ([], None)
            continue
        m = ENTRY.match(line)
        if line.strip() and m and not line.startswith(" " * 20):  # continuation lines are indented past the names
            indent, name = len(m.group(1)), m.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else None
            if name.endswith("/") and parent is not None:
                path = f"{parent}{name}"
                stack.append((indent, path))
                folder = path
            else:
                folder = parent
                if folder is not None and name.endswith(".py"):
                    named.setdefault(folder, set()).add(name)
                    continue
        if folder is not None:  # module names inside a description (hubserver/'s files, the family builders)
            for mod in re.findall(r"\b([a-z_0-9]+\.py)\b", line):
                named.setdefault(folder, set()).add(mod)
    return named


def test_every_module_is_in_the_design_tree_and_every_named_module_exists() -> None:
    named = _tree()
    package = ROOT / "publisher"
    actual: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        folder = path.parent.relative_to(package).as_posix()
        actual.setdefault("" if folder == "." else folder + "/", set()).add(path.name)
    missing = sorted(f"publisher/{f}{m}" for f, mods in actual.items() for m in mods - named.get(f, set()))
    stale = sorted(f"publisher/{f}{m}" for f, mods in named.items() for m in mods - actual.get(f, set()))
    assert not missing, f"modules missing from docs/design.md's tree: {missing}"
    assert not stale, f"docs/design.md's tree names modules that do not exist: {stale}"
