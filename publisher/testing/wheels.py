"""Hand-written wheels and package indexes in folders, so that tests of environment builds need no package index."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def write_wheel(folder: Path, name: str, version: str, code: str) -> Path:
    """A minimal pure-Python wheel of one module (``code`` is its ``__init__.py``), written by hand."""
    module = name.replace("-", "_")
    dist = f"{module}-{version}"
    files = {
        f"{module}/__init__.py": code,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    out = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return out


def simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index in a folder (pip reads it from file:// as from https://), one page per project; its URL."""
    (root / "simple").mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        project = root / "simple" / wheel.name.split("-")[0].replace("_", "-")
        project.mkdir(parents=True, exist_ok=True)
        (project / wheel.name).write_bytes(wheel.read_bytes())
        links = "".join(f'<a href="{w.name}">{w.name}</a>\n' for w in sorted(project.glob("*.whl")))
        (project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return (root / "simple").as_uri() + "/"
