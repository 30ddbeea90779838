"""Preflight: is there enough disk and memory for the plan? Estimated from file sizes and the
meta-device structure, before any weight is downloaded."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import ResourceError
from .plan import Plan

log = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True)
class Estimate:
    download_bytes: int  # base files not yet on local disk
    output_bytes: int  # every recipe's repo folder
    peak_memory_bytes: int  # library path: the largest component, bf16 + quantized copy while saving


def estimate(plan: Plan, engine: str = "auto") -> Estimate:
    src = plan.source
    download = 0 if src.local_dir is not None else sum(src.sizes.get(f, 0) for f in plan.base_files)
    kept = sum(src.sizes.get(f, 0) for f in plan.base_files
               if not any(f.startswith(f"{c.name}/") or (not c.name and "/" not in f) for c in plan.quantized))
    output = 0
    for recipe in plan.recipes:
        quantized = sum(c.param_bytes * recipe.bits // 16 for c in plan.quantized)
        output += kept + quantized
    largest = max((c.param_bytes for c in plan.quantized), default=0)
    if engine == "library":
        # measured: the library path peaks at about 2x the bf16 size (model + torchao's flattening copies)
        return Estimate(download, output, 2 * largest + GiB // 2)
    # streaming: about 1 GiB to quantize; then verification reloads the quantized component in a
    # fresh process (the quality check against bf16 is skipped when the base would not fit)
    bits = max((r.bits for r in plan.recipes), default=8)
    return Estimate(download, output, largest * bits // 16 + GiB)


def check(plan: Plan, output_root: Path, cache_dir: Path, engine: str = "auto") -> Estimate:
    import psutil

    est = estimate(plan, engine)
    needs: dict[Path, int] = {}
    for path, size in ((_existing(cache_dir), est.download_bytes), (_existing(output_root), est.output_bytes)):
        needs[path] = needs.get(path, 0) + size
    # two folders on one filesystem share its free space
    by_device: dict[int, tuple[Path, int]] = {}
    for path, size in needs.items():
        dev = path.stat().st_dev
        prev = by_device.get(dev, (path, 0))
        by_device[dev] = (prev[0], prev[1] + size)
    for path, size in by_device.values():
        free = shutil.disk_usage(path).free
        if size > free:
            raise ResourceError(
                f"not enough disk at {path}: the plan needs about {size / 1e9:.1f} GB "
                f"(download {est.download_bytes / 1e9:.1f} GB, output {est.output_bytes / 1e9:.1f} GB), "
                f"{free / 1e9:.1f} GB free; free space or point --output-dir / HF_HOME at a larger disk"
            )
    total = psutil.virtual_memory().total
    if est.peak_memory_bytes > total:
        raise ResourceError(
            f"not enough memory: quantizing the largest component needs about {est.peak_memory_bytes / GiB:.1f} GiB, "
            f"this machine has {total / GiB:.1f} GiB; use a machine with more memory"
        )
    return est


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path
