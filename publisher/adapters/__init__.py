"""The model libraries, one adapter class each: the one place that knows diffusers from transformers.

A component names its library as model_index.json does ("diffusers", "transformers"); ``of`` turns that name into the
library's adapter class, whose facts and classmethods (loading, the default skips, which table entry applies to a
layer, the card's snippet names...) the rest of the code asks instead of comparing names, and whose instances are the
streaming engine's meta-device models (adapters/base.py). Nothing here imports torch or the libraries until asked.
"""

from __future__ import annotations

from publisher.adapters.base import LibraryAdapter
from publisher.adapters.diffusers import DiffusersAdapter
from publisher.adapters.transformers import TransformersAdapter

_ADAPTERS: dict[str, type[LibraryAdapter]] = {a.library: a for a in (DiffusersAdapter, TransformersAdapter)}
LIBRARIES = tuple(_ADAPTERS)  # the libraries we have adapters for: what a component's library may be

__all__ = ["LIBRARIES", "DiffusersAdapter", "LibraryAdapter", "TransformersAdapter", "of"]


def of(library: str) -> type[LibraryAdapter]:
    """The adapter class of ``library``; ValueError for a library we have no adapter for (check ``LIBRARIES`` first
    where the name comes from the user's files)."""
    try:
        return _ADAPTERS[library]
    except KeyError:
        raise ValueError(f"library {library!r} is not one of {', '.join(LIBRARIES)}") from None
