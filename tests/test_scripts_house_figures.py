"""scripts/house_figures.py: the house's figures, and the bounds the third restructuring issue set that they keep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "house_figures.py"


def _figures() -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json"], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_the_library_names_are_compared_in_the_adapters_and_loadpath_only() -> None:
    """The adapters are the one place that knows diffusers from transformers; loadpath.py (a script in other
    interpreters, importing nothing of ours) keeps its own few."""
    f = _figures()
    assert f["library_comparisons_outside_adapters"] <= 4, f["library_comparisons_by_module"]
    assert set(f["library_comparisons_by_module"]) <= {"publisher/loadpath.py"}, f["library_comparisons_by_module"]


def test_the_request_reads_as_a_few_groups() -> None:
    assert 0 < _figures()["publish_request_fields"] <= 12


def test_the_command_docs_design_md_shows() -> None:
    """`python scripts/house_figures.py`, from the project root, as docs/design.md shows it."""
    proc = subprocess.run([sys.executable, "scripts/house_figures.py"], cwd=ROOT, capture_output=True, text=True,
                          check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("library-name comparisons outside publisher/adapters/: ")
    assert [line.split(":")[0] for line in lines[1:]] == [
        "our own imports inside functions", "parameters annotated with a bare Any", "PublishRequest top-level fields"]


def test_the_counts_see_what_they_count(tmp_path: Path) -> None:
    """The script counts a comparison, an import inside a function and a bare Any it is shown (so a zero above means
    none, not a blind count)."""
    package = tmp_path / "publisher"
    (package / "adapters").mkdir(parents=True)
    (package / "m.py").write_text(
        "from typing import Any\nfrom publisher import x\n\n\ndef f(a: Any, lib: str) -> bool:\n"
        "    from publisher import y\n    return lib == 'diffusers'\n")
    (package / "adapters" / "a.py").write_text("def g(lib):\n    return lib != 'transformers'\n")
    copy = tmp_path / "scripts"
    copy.mkdir()
    (copy / "house_figures.py").write_text(SCRIPT.read_text())
    proc = subprocess.run([sys.executable, str(copy / "house_figures.py"), "--json"], capture_output=True, text=True,
                          check=True)
    f = json.loads(proc.stdout)
    assert f["library_comparisons_by_module"] == {"publisher/m.py": ["7: lib == 'diffusers'"]}
    assert (f["internal_imports_top"], f["internal_imports_in_functions"], f["bare_any_parameters"]) == (1, 1, 1)
    assert f["publish_request_fields"] is None
