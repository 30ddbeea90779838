"""Preflight: is there enough disk and memory for the plan? Estimated from file sizes and the
meta-device structure, before any weight is downloaded."""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from publisher.errors import ResourceError
from publisher.handoffs.plan import Plan
from publisher.request import low_disk_conflict, size_bytes
from publisher.stages.fetch import weight_files
from publisher.stages.hubcopy import unchanged_files
from publisher.stages.lowdisk_push import LOW_DISK_SHARD, OVERLAP

log = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True)
class Estimate:
    download_bytes: int  # base files not yet on local disk
    output_bytes: int  # every recipe's repo folder
    peak_memory_bytes: int  # library path: the largest component, bf16 + quantized copy while saving
    low_disk: bool = False  # the quantized components' weights are read by HTTP range, not downloaded
    # --low-disk: bytes read in execution order ahead of a shard's file-order hash wait in the temp folder
    # (integrity.SpillingHashedReader). Counted as the largest base weight file of a quantized component: the
    # spill of one file never exceeds it, and the libraries shard in module order, so execution order finishes
    # one file before it goes far into the next (FLUX.1-dev: 5.44 GB at most, of a 9.98 GB file, by
    # benchmarks/spill_layout.py).
    spill_bytes: int = 0


def estimate(plan: Plan, engine: str = "auto", low_disk: bool = False, push: bool = False,
             max_shard_size: str | None = None) -> Estimate:
    """``low_disk`` and ``push``: output shards are uploaded and deleted as they are finished, so the output folder
    holds about one shard plus lowdisk_push.OVERLAP at a time, and the files the run does not change go from the base
    repo to the target without touching the disk."""

    src = plan.source
    staged = low_disk and push
    remote = {f for c in plan.quantized for f in weight_files(plan, c)} if low_disk else set()
    elsewhere = set(unchanged_files(plan)) if staged and src.repo_id else set()
    download = 0 if src.local_dir is not None else sum(src.sizes.get(f, 0) for f in plan.base_files
                                                        if f not in remote and f not in elsewhere)
    kept = sum(src.sizes.get(f, 0) for f in plan.base_files if f not in elsewhere
               and not any(f.startswith(f"{c.name}/") or (not c.name and "/" not in f) for c in plan.quantized))
    shard = size_bytes(max_shard_size or LOW_DISK_SHARD) + OVERLAP
    output = 0
    for recipe in plan.recipes:
        sizes = [int(c.param_bytes * recipe.bits / 16) for c in plan.quantized]  # the configs' stored bits (int4 unpacked: ~8.75)
        output += kept + (min(max(sizes, default=0), shard) if staged else sum(sizes))
    largest = max((c.param_bytes for c in plan.quantized), default=0)
    if engine == "library":
        # measured: the library path peaks at about 2x the bf16 size (model + torchao's flattening copies)
        return Estimate(download, output, 2 * largest + GiB // 2, low_disk)
    spill = max((src.sizes.get(f, 0) for f in remote), default=0)
    # streaming: about 1 GiB to quantize; verification reloads the quantized component when it fits,
    # and otherwise checks it tensor by tensor and block by block (--verify-mode auto), in about as much
    return Estimate(download, output, GiB + GiB // 4, low_disk, spill)


def _fits(est: Estimate, output_root: Path, cache_dir: Path) -> tuple[Path, int, int] | None:
    """None when both folders have room; else (folder, bytes needed, bytes free) of the first short one."""
    needs: dict[Path, int] = {}
    for path, size in ((_existing(cache_dir), est.download_bytes), (_existing(output_root), est.output_bytes),
                       (_existing(Path(tempfile.gettempdir())), est.spill_bytes)):
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
            return path, size, free
    return None


def check(plan: Plan, output_root: Path, cache_dir: Path, engine: str = "auto", low_disk: bool | None = False,
          push: bool = False, max_shard_size: str | None = None) -> Estimate:
    """Disk and memory for the plan. ``low_disk`` None (auto): switch to HTTP range reads of the quantized
    components' weights when downloading them would not fit but streaming them would."""
    import psutil

    est = estimate(plan, engine, bool(low_disk), push, max_shard_size)
    short = _fits(est, output_root, cache_dir)
    hint = ""
    if short and not low_disk and engine != "library" and plan.source.local_dir is None and plan.quantized:
        lean = estimate(plan, engine, True, push, max_shard_size)
        lean_short = _fits(lean, output_root, cache_dir)
        if low_disk is False:  # --no-low-disk
            hint = ", or drop --no-low-disk" if lean_short is None else ""
        elif lean_short is None:
            log.info("not enough disk to download the base (%.1f GB needed, %.1f GB free at %s): reading the "
                     "quantized components' weights by HTTP range instead (--low-disk)", short[1] / 1e9, short[2] / 1e9, short[0])
            est, short = lean, None
        else:
            est, short = lean, lean_short  # even streaming does not fit: report its (smaller) needs
    if short:
        path, size, free = short
        raise ResourceError(
            f"not enough disk at {path}: the plan needs about {size / 1e9:.1f} GB "
            f"(download {est.download_bytes / 1e9:.1f} GB, output {est.output_bytes / 1e9:.1f} GB"
            + (f", read-ahead spill up to {est.spill_bytes / 1e9:.1f} GB in the temp folder" if est.spill_bytes else "")
            + f"), {free / 1e9:.1f} GB free; free space or point --output-dir / HF_HOME"
            + (" / TMPDIR" if est.spill_bytes else "") + f" at a larger disk{hint}"
        )
    total = psutil.virtual_memory().total
    if est.peak_memory_bytes > total:
        raise ResourceError(
            f"not enough memory: quantizing the largest component needs about {est.peak_memory_bytes / GiB:.1f} GiB, "
            f"this machine has {total / GiB:.1f} GiB; use a machine with more memory"
        )
    return est


def check_low_disk(low_disk: bool, push: bool, *, benchmark: bool, verify_envs: bool) -> None:
    """What needs the base or the output whole on disk cannot run when they do not fit (``low_disk`` chosen here):
    low_disk_conflict's rule, the one the CLI applies to --low-disk."""
    conflict = low_disk and low_disk_conflict(benchmark=benchmark, verify_envs=verify_envs, push=push)
    if conflict:
        option = "--benchmark" if benchmark else "--verify-env"
        raise ResourceError(f"the base does not fit on disk, so the run would go --low-disk, and {conflict}; drop "
                            f"{option} or free disk space")


def _existing(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path
