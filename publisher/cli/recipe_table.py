"""`hf-ao-publish recipes` as text: the registry, one block per recipe, wrapped for a terminal."""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING

from publisher import recipes as recipe_registry

if TYPE_CHECKING:
    from collections.abc import Sequence

    from publisher.flavors import Flavor

RECIPES_WIDTH = 100  # `hf-ao-publish recipes` fits a 100-column terminal


def recipes_text(width: int = RECIPES_WIDTH, flavors: Sequence[Flavor] | None = None, source: str = "builtin") -> str:
    """The registry as text: one block per recipe, every line at most ``width`` columns. ``flavors``: the
    Hugging Face Jobs hardware (the Hub's list, from ``source``; default: the built-in table)."""
    label_width = 11
    indent = " " * (2 + label_width + 2)
    where = "the Hub's hardware list" if source == "hub" else "the built-in table (the Hub's list was not reachable)"
    lines = ["Recipes for --quant (hf-ao-publish MODEL_ID --quant RECIPE):",
             *textwrap.wrap(f"hf jobs: the smallest Hugging Face Jobs flavors for --on-hf-jobs, from {where}.", width)]
    for recipe in recipe_registry.all_recipes():
        data = recipe.to_dict(flavors)
        lines += ["", *textwrap.wrap(f"{recipe.name}  {recipe.summary}", width, subsequent_indent="    ")]
        facts = [("quantize on", data["quantize_on"]["text"]), ("run on", data["run_on"]["text"]),
                 ("speed-ups", data["speedup"]), ("storage", data["storage"]), ("config", recipe.expression),
                 ("hf jobs", recipe.hf_jobs_text(flavors)), *(("note", note) for note in data["notes"])]
        for label, text in facts:
            if label == "hf jobs":  # keep "l4x1 (L4, CC 8.9)" on one line: protect the spaces inside parentheses
                text = re.sub(r"\S+ \([^)]*\)", lambda m: m.group(0).replace(" ", "\0"), text)
            lines += [line.replace("\0", " ") for line in textwrap.wrap(
                text, width, initial_indent=f"  {label:<{label_width}}  ", subsequent_indent=indent, break_on_hyphens=False)]
    return "\n".join(lines)
