"""The grid's memory: what each pipeline call took at its peak, and which sizes stay within the run's bound.

A publish with the streaming engine or ``--low-disk`` keeps its process tree within ``BOUND`` (1.2 GiB,
docs/benchmarks.md); the grid keeps to it as well. Its pipelines run offloaded (one block of weights at a time), so
what grows with the size is the activations: the hidden states of every image token in each block, and the VAE's
feature maps at the image's full resolution (a FLUX-shaped block pair under ``--low-disk``: 1.01 GiB at the peak of a
1024 px call on its own, 0.69 GiB at 128 px).

Each timing call is watched (``Watch``: this process's resident memory sampled every 20 ms, plus what its children
hold), and a larger size is timed only when the last measured call's growth, scaled by the pixels (conservative: the
block loads in it do not grow), still fits: ``fits``. The peak RSS counter itself (VmHWM, ``ru_maxrss``) is left alone,
since the run reports it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

BOUND = int(1.2 * 2**30)  # the process tree's bound for the streaming engine and --low-disk (docs/benchmarks.md)
SAMPLE_S = 0.02


def own_rss() -> int:
    """This process's resident memory now (``/proc/self/statm``; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def children_rss() -> int:
    """What the process's children (kept interpreters, workers) hold now."""
    import psutil

    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:  # gone meanwhile
            continue
    return total


def tree_rss() -> int:
    return own_rss() + children_rss()


@dataclass
class Measured:
    size: int  # px
    start: int  # the tree's resident bytes before the call
    peak: int  # the tree's highest resident bytes during it

    @property
    def growth(self) -> int:
        return max(self.peak - self.start, 0)


class Watch:
    """``with Watch(size) as m:`` samples this process's resident memory until the block ends; ``m.peak`` is the
    tree's highest (its children counted as they were at the start)."""

    def __init__(self, size: int) -> None:
        self.children = children_rss()
        self.measured = Measured(size, own_rss() + self.children, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="grid-memory", daemon=True)

    def _sample(self) -> None:
        while True:
            self.measured.peak = max(self.measured.peak, own_rss() + self.children)
            if self._stop.wait(SAMPLE_S):
                return

    def __enter__(self) -> Measured:
        self._thread.start()
        return self.measured

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.measured.peak = max(self.measured.peak, own_rss() + self.children)


def predicted(size: int, measured: list[Measured], now: int) -> int:
    """The tree's peak during a call at ``size`` px: what it holds ``now`` plus the growth of the largest measured
    call at or below ``size``, times the ratio of their pixels (activations grow with the pixels; the block loads
    in the measured growth do not, so this is on the safe side)."""
    below = [m for m in measured if m.size <= size] or measured
    ref = max(below, key=lambda m: (m.size, m.growth))
    return now + int(ref.growth * (size / ref.size) ** 2)


MIN_ROOM = 64 << 20  # what the grid may add even when the run holds more than the bound when it starts (below)


def limit(bounded: bool) -> int | None:
    """The process tree's most during the grid: ``BOUND``, or, when the tree already holds more when the grid starts,
    that plus ``MIN_ROOM`` (the test suite runs the CLI inside its workers, whose memory is not the CLI's: they still
    get the smallest grid). None: the run has no bound (the library engine loads whole models anyway)."""
    return max(BOUND, tree_rss() + MIN_ROOM) if bounded else None


def fits(size: int, measured: list[Measured], limit: int | None) -> bool:
    """A call at ``size`` stays within ``limit`` (a tree RSS; always, when there is none or nothing was measured
    yet)."""
    if limit is None or not measured:
        return True
    return predicted(size, measured, tree_rss()) <= limit
