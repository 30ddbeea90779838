"""Hugging Face Jobs hardware flavors: what each one offers, and the built-in table used when the Hub's
own list (`HfApi.list_jobs_hardware`, `hf jobs hardware`) cannot be read.

The registry (recipes.py) matches a recipe's needs against these; the remote run (publisher/hfjobs/)
refuses a flavor that cannot make or run a recipe before anything is submitted. The compute capability
is not part of the Hub's answer, so it comes from the GPU model name (NVIDIA's published figures).
Pure data: no network, no heavy import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# CUDA compute capability by the accelerator model the Hub reports (JobAccelerator.model).
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "T4": (7, 5),
    "V100": (7, 0),
    "A10G": (8, 6),
    "A10": (8, 6),
    "A100": (8, 0),
    "L4": (8, 9),
    "L40S": (8, 9),
    "H100": (9, 0),
    "H200": (9, 0),
    "B200": (10, 0),
    "RTX PRO 6000": (12, 0),
}


def _normalise_model(model: str) -> str:
    return re.sub(r"\s+", " ", model.upper().replace("NVIDIA", "").replace("-", " ")).strip()


_CAPABILITY_BY_KEY = {_normalise_model(k): v for k, v in GPU_CAPABILITY.items()}


def capability_of(model: str | None) -> tuple[int, int] | None:
    """The compute capability of a GPU model name ("L4", "Nvidia A10G", "RTX PRO 6000"); None if unknown."""
    if not model:
        return None
    return _CAPABILITY_BY_KEY.get(_normalise_model(model))


@dataclass(frozen=True)
class Flavor:
    """One Jobs hardware flavor. ``gpu`` is None for CPU-only flavors."""

    name: str
    gpu: str | None = None  # accelerator model, as the Hub names it
    gpus: int = 0
    vram: str = ""  # as the Hub writes it ("24 GB"); informative only
    cost: float | None = None  # the Hub's unit cost in USD (live list only)
    cost_unit: str = ""

    @property
    def capability(self) -> tuple[int, int] | None:
        return capability_of(self.gpu)

    def describe(self) -> str:
        """`l4x1 (L4, CC 8.9)`, `cpu-basic`: the name with what matters for a recipe."""
        if self.gpu is None:
            return self.name
        cc = self.capability
        count = f"{self.gpus}x " if self.gpus > 1 else ""
        return f"{self.name} ({count}{self.gpu}, CC {cc[0]}.{cc[1]})" if cc else f"{self.name} ({count}{self.gpu})"


# Smallest first (by GPU count, then GPU memory, then CPU size), so the first fitting flavor is the
# smallest one; the Hub's live list is ordered by its price instead. Names are huggingface_hub's
# JobHardware values; the GPU models and memory are the Hub's descriptions of them.
BUILTIN: tuple[Flavor, ...] = (
    Flavor("cpu-basic"),
    Flavor("cpu-upgrade"),
    Flavor("cpu-performance"),
    Flavor("cpu-xl"),
    Flavor("t4-small", "T4", 1, "16 GB"),
    Flavor("t4-medium", "T4", 1, "16 GB"),
    Flavor("l4x1", "L4", 1, "24 GB"),
    Flavor("a10g-small", "A10G", 1, "24 GB"),
    Flavor("a10g-large", "A10G", 1, "24 GB"),
    Flavor("l40sx1", "L40S", 1, "48 GB"),
    Flavor("a100-large", "A100", 1, "80 GB"),
    Flavor("rtx-pro-6000", "RTX PRO 6000", 1, "96 GB"),
    Flavor("h200", "H200", 1, "141 GB"),
    Flavor("a10g-largex2", "A10G", 2, "48 GB"),
    Flavor("rtx-pro-6000x2", "RTX PRO 6000", 2, "192 GB"),
    Flavor("h200x2", "H200", 2, "282 GB"),
    Flavor("l4x4", "L4", 4, "96 GB"),
    Flavor("a10g-largex4", "A10G", 4, "96 GB"),
    Flavor("l40sx4", "L40S", 4, "192 GB"),
    Flavor("a100x4", "A100", 4, "320 GB"),
    Flavor("rtx-pro-6000x4", "RTX PRO 6000", 4, "384 GB"),
    Flavor("h200x4", "H200", 4, "564 GB"),
    Flavor("l40sx8", "L40S", 8, "384 GB"),
    Flavor("a100x8", "A100", 8, "640 GB"),
    Flavor("rtx-pro-6000x8", "RTX PRO 6000", 8, "768 GB"),
    Flavor("h200x8", "H200", 8, "1128 GB"),
)


def from_hub(entries: Iterable[Any]) -> list[Flavor]:
    """Flavors from `list_jobs_hardware()` (JobHardwareInfo objects), cheapest first (stable for ties)."""
    found = []
    for entry in entries:
        acc = getattr(entry, "accelerator", None)
        try:
            count = int(str(getattr(acc, "quantity", "0") or "0").strip() or 0) if acc else 0
        except ValueError:
            count = 1
        found.append(Flavor(
            name=str(entry.name),
            gpu=str(acc.model) if acc is not None and str(getattr(acc, "type", "gpu")).lower() == "gpu" else None,
            gpus=count,
            vram=str(getattr(acc, "vram", "") or "") if acc else "",
            cost=float(entry.unit_cost_usd) if getattr(entry, "unit_cost_usd", None) is not None else None,
            cost_unit=str(getattr(entry, "unit_label", "") or ""),
        ))
    return sorted(found, key=lambda f: f.cost if f.cost is not None else float("inf"))


def find(name: str, flavors: Iterable[Flavor]) -> Flavor | None:
    return next((f for f in flavors if f.name == name), None)
