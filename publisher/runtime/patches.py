"""Attributes of another library replaced while at least one holder is inside: the library's code as we need it for the
duration (fp8cpu's CPU float8 quantization, streaming/fp8blocks' row blocks), and as it was after.

A ``Patches`` is re-entrant (nested and concurrent holders share one set of replacements, installed by the first and
removed by the last) and process-wide while held: the replaced attributes are the library's, seen by every thread.
What is saved and put back is the attribute as its owner holds it (a class's ``classmethod`` object, not the bound
method); one the owner only inherits is deleted again, so the inherited one shows through.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

_MISSING = object()


class Patches:
    """One set of replacements: ``held(install)`` runs ``install`` when it is the first holder and puts the saved
    attributes back when the last one leaves."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._saved: list[tuple[object, str, object]] = []

    @contextmanager
    def held(self, install: Callable[[], Mapping[tuple[object, str], object]]) -> Iterator[None]:
        """``install`` returns ``{(owner, attribute name): replacement}``; it is called only by the first holder (it
        may read the attributes it replaces: they are still the library's)."""
        with self._lock:
            if self._depth == 0:
                for (owner, name), new in install().items():
                    self._saved.append((owner, name, vars(owner).get(name, _MISSING)))
                    setattr(owner, name, new)
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    for owner, name, old in reversed(self._saved):
                        if old is _MISSING:
                            delattr(owner, name)
                        else:
                            setattr(owner, name, old)
                    self._saved.clear()
