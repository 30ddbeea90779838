"""Combinations of installed releases known not to work as this tool needs, said in one line at start-up.

The package metadata states tested ranges (pyproject.toml) so that the tool installs next to a user's torch; inside
those ranges some combinations are still known to be degraded. Read from the installed distributions' metadata only
(no import: ``--help`` stays instant).
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    package: str
    versions: str  # a specifier set for ``package``
    needs: str  # the package whose range makes it broken
    range: str  # a specifier set for ``needs`` under which it is broken
    what: str


KNOWN: tuple[Known, ...] = (
    # torchao/__init__.py of 0.18.0: the compiled kernels are loaded only with torch >= 2.11 (else skipped with a warning)
    Known("torchao", ">=0.18,<0.19", "torch", "<2.11", "torchao {v} loads its compiled kernels only with torch >= 2.11; "
          "with torch {n} they are skipped (int4 and float8 kernels missing): install torch >= 2.11"),
)


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def broken() -> list[str]:
    """One sentence per known-broken combination installed here."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    out = []
    for k in KNOWN:
        v, n = _version(k.package), _version(k.needs)
        if v is None or n is None:
            continue
        try:
            if Version(v) in SpecifierSet(k.versions) and Version(n.split("+")[0]) in SpecifierSet(k.range):
                out.append(k.what.format(v=v, n=n))
        except InvalidVersion:
            continue
    return out
