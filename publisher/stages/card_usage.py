"""What the card's "How to use" snippets depend on: the pipeline's output kind, the call arguments it takes, the
sizes that suit a GPU and a CPU, and the manual load path's code, which is ``loadpath``'s own (read with inspect).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from publisher import adapters, loadpath
from publisher.adapters.diffusers import output_kind

CPU_SIZE, CPU_STEPS, CPU_FRAMES = 256, 4, 9  # a CPU run in minutes for a multi-billion-parameter model
GPU_FRAMES = 49  # valid for CogVideoX, Wan and LTX-Video ((n - 1) divisible by 8)


@dataclass
class Usage:
    """How the usage snippet calls the pipeline."""

    kind: str  # "image" | "video" | "audio"
    gpu: dict[str, int] = field(default_factory=dict)  # size, steps (and frames) on a GPU
    cpu: dict[str, int] = field(default_factory=dict)  # the same on a CPU
    max_area: bool = False  # the pipeline resizes to max_area (FLUX Kontext): pass size * size

    @property
    def same(self) -> bool:
        """The card's size and steps fit a CPU already: the snippet has one line for both devices."""
        return self.gpu == self.cpu


def usage(pipeline_class: str | None, size: int, steps: int) -> Usage:
    """The snippet's call: ``size``/``steps`` (--sample-size, --sample-steps) on a GPU, at most 256 px and 4 steps
    (and 9 frames) on a CPU."""
    import diffusers

    kind = output_kind(pipeline_class)
    cls = getattr(diffusers, pipeline_class or "", None)
    params = inspect.signature(cls.__call__).parameters if cls is not None else {}
    gpu = {"size": size, "steps": steps}
    cpu = {"size": min(size, CPU_SIZE), "steps": min(steps, CPU_STEPS)}
    if kind == "video" and "num_frames" in params:
        gpu["frames"], cpu["frames"] = GPU_FRAMES, CPU_FRAMES
    return Usage(kind, gpu, cpu, max_area="max_area" in params)


def manual_functions(library: str) -> str:
    """The source of the functions the manual load path runs in verification, for the card (the same code)."""
    functions: list[Callable[..., Any]] = [loadpath.read_checkpoint, loadpath.load_into]
    if adapters.of(library).renames_checkpoint_keys:
        functions.insert(1, loadpath.convert_checkpoint_keys)
    return "\n\n".join(inspect.getsource(f).rstrip() for f in functions)
