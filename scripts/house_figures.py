"""Figures of the house that docs/design.md and the restructuring issues quote, counted from the code's syntax (no
import of the package, standard library only):

- library-name comparisons: ``==`` / ``!=`` / ``in`` with a "diffusers" or "transformers" literal, per module (the
  adapters, publisher/adapters/, are the place that knows the libraries apart; loadpath.py runs as a script in other
  interpreters and imports nothing of ours);
- our own imports made inside functions, against those at the top (``if TYPE_CHECKING:`` blocks not counted);
- parameters annotated with a bare ``Any``;
- the top-level fields of ``PublishRequest``.

    python scripts/house_figures.py [--json] [--verbose]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "publisher"
LIBRARIES = {"diffusers", "transformers"}
SKIPPED = ("testing",)  # test infrastructure is no part of the product's house


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not set(SKIPPED) & set(p.relative_to(PACKAGE).parts))


def _names_a_library(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in LIBRARIES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_library(e) for e in node.elts)
    return False


def _ids_under(nodes: list[ast.AST]) -> set[int]:
    return {id(m) for n in nodes for m in ast.walk(n)}


def figures() -> dict[str, object]:
    comparisons: dict[str, list[str]] = {}
    inside, top, bare_any = 0, 0, 0
    request_fields = None
    for path in _modules():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), rel)
        types_only = _ids_under([n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)])
        in_functions = _ids_under([n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))])
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(_names_a_library(x) for x in (node.left, *node.comparators)):
                if not rel.startswith("publisher/adapters/"):
                    comparisons.setdefault(rel, []).append(f"{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and id(node) not in types_only and (
                    node.level or (node.module or "").startswith("publisher")):
                if id(node) in in_functions:
                    inside += 1
                else:
                    top += 1
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                bare_any += sum(1 for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
                                if a.annotation is not None and ast.unparse(a.annotation) == "Any")
            elif isinstance(node, ast.ClassDef) and node.name == "PublishRequest" and rel == "publisher/request.py":
                request_fields = sum(1 for b in node.body if isinstance(b, ast.AnnAssign))
    return {
        "library_comparisons_outside_adapters": sum(len(v) for v in comparisons.values()),
        "library_comparisons_by_module": comparisons,
        "internal_imports_top": top,
        "internal_imports_in_functions": inside,
        "bare_any_parameters": bare_any,
        "publish_request_fields": request_fields,
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--verbose", action="store_true", help="list each library-name comparison")
    a = ap.parse_args(argv)
    f = figures()
    if a.json:
        print(json.dumps(f, indent=2))
        return 0
    by_module = f["library_comparisons_by_module"]
    assert isinstance(by_module, dict)
    inside, top = f["internal_imports_in_functions"], f["internal_imports_top"]
    assert isinstance(inside, int) and isinstance(top, int)
    print(f"library-name comparisons outside publisher/adapters/: {f['library_comparisons_outside_adapters']} "
          f"in {len(by_module)} modules")
    if a.verbose:
        for module, found in by_module.items():
            for line in found:
                print(f"  {module}:{line}")
    print(f"our own imports inside functions: {inside} of {inside + top} ({100 * inside / max(inside + top, 1):.0f}%)")
    print(f"parameters annotated with a bare Any: {f['bare_any_parameters']}")
    print(f"PublishRequest top-level fields: {f['publish_request_fields']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
