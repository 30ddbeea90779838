"""One grid, within its budget: time the base pipeline, choose the size and steps, make the base images, then the
quantized ones, re-planning after every image; what finished when the time ran out is the grid.

    run = GridRun(figures, deadline, denoiser="transformer", device="cpu", load_s=1.2)
    run.base(pipe)          # timing calls (one step at 64 and 128 px, then once at the chosen size), the base images
    run.quantized(pipe)     # the quantized images, as many as the base made and the time allows
    pairs = run.pairs()     # (base image, quantized image) for each finished prompt

Every image is one stderr line (which, how long, the time left). The deadline is checked before every denoiser step and
decode (``budget.Timer``), so the stage stops within one step of ``--eval-budget`` whatever the timing model said.
"""

from __future__ import annotations

import logging
from typing import Any

from publisher.quality import budget, images, memory
from publisher.quality.budget import Deadline, Model, OutOfTime, Timer
from publisher.quality.grid import CPU_SIZES, CPU_STEPS, MIN_SIZE, GridFigures, image
from publisher.quality.reference import GridReference

log = logging.getLogger(__name__)

# The first call of a pipeline also does its one-time work (lazy initialisation of kernels and tokenizers: 2-3 s for
# a tiny FLUX whose later 64 px calls take 0.5 s), so the smallest size is timed twice and the second counts
PROBE_SIZES = (64, 64, 128)
# timing calls at most before a size is chosen (a size left out for memory costs one more, at the next size down)
MAX_PROBES = 6
# The quantized pipeline is planned at this multiple of the base's time per image until one of its images is timed:
# on a CPU torchao's weight-only kernels dequantize as they go and can be slower than bf16 (float8wo: about 1.3x here)
FIRST_SLOWER = 1.5


class GridRun:
    def __init__(self, figures: GridFigures, deadline: Deadline, denoiser: str, device: str, load_s: float,
                 memory_limit: int | None = None) -> None:
        self.figures, self.deadline, self.denoiser, self.device = figures, deadline, denoiser, device
        self.memory_limit = memory_limit  # the process tree's most (memory.limit), None: no bound
        self.measured: list[memory.Measured] = []  # the timing calls' memory
        self.load_s = load_s  # what opening the base pipeline took: the quantized one is planned at the same
        size, steps = figures.asked
        self.sizes = [s for s in CPU_SIZES if s <= size] or [max(size, MIN_SIZE)]
        self.steps = sorted({min(s, steps) for s in CPU_STEPS}, reverse=True)
        self.base_images: list[Any] = []
        self.quantized_images: list[Any] = []
        self.base_times: list[float] = []
        self.quantized_times: list[float] = []
        self.prompts = 0  # how many prompts the plan runs (0: no grid)

    # ---------------------------------------------------------------- base
    def base(self, pipe: Any) -> None:
        try:
            with Timer(pipe, getattr(pipe, self.denoiser), self.deadline) as timer:
                model = self._probe(pipe, timer)
                if model is None:
                    return
                self._base_images(pipe, timer, model)
        except OutOfTime as exc:
            self._stopped(str(exc), "base")

    def _probe(self, pipe: Any, timer: Timer) -> Model | None:
        """Time one step and one decode at the probe sizes, then at the size the model picks, until the choice is a
        size that was timed; None (with the reason in the figures) when nothing fits."""
        probes: list[tuple[int, budget.Call]] = []
        prompt, seed = self.figures.prompts[0], self.figures.seeds[0]
        too_big: set[int] = set()
        sizes = [s for s in PROBE_SIZES if s <= self.sizes[0]] or [self.sizes[-1]]
        while True:
            for size in sizes:
                repeat = size in {s for s, _ in probes}  # the warm-up's size again: the measurement that counts
                share = 2 * budget.PROBE_SHARE if repeat else budget.PROBE_SHARE
                if probes and Model.fit(probes).per_image(size, 1) > share * self.deadline.left():
                    if not repeat:
                        too_big.add(size)
                    break
                if not memory.fits(size, self.measured, self.memory_limit):
                    self._over_memory(size, too_big, memory.predicted(size, self.measured, memory.tree_rss()))
                    break
                with memory.Watch(size) as used, timer.call() as call:
                    image(pipe, prompt, seed, size, 1, self.device)
                self.measured.append(used)
                self.figures.peak_rss_bytes = max(self.figures.peak_rss_bytes, used.peak)
                if self.memory_limit is not None and used.peak > self.memory_limit:  # misjudged: never again this big
                    self._over_memory(size, too_big, used.peak, measured=True)
                probes.append((size, call))
                self.figures.probes.append({"size": size, "seconds": round(call.seconds, 3)})
                log.info("grid: timed the base pipeline at %d px, one step: %.1f s (%.0f s of --eval-budget left)", size,
                         call.seconds, self.deadline.left())
            model = Model.fit(probes)
            allowed = [s for s in self.sizes if s not in too_big]
            if not allowed:
                self.figures.reason = (f"even {self.sizes[-1]}x{self.sizes[-1]} px would take the process over the run's "
                                       f"memory bound ({self.figures.memory_limited})")
                log.warning("no comparison grid: %s", self.figures.reason)
                return None
            choice = budget.choose(model, self.deadline.left(), allowed, self.steps, len(self.figures.prompts),
                                   FIRST_SLOWER, self.load_s)
            if choice is None:
                self._no_grid(model)
                return None
            if choice.size in model.sizes or len(probes) >= MAX_PROBES:
                self._chosen(choice)
                return model
            sizes = [choice.size]  # time it for real before running it

    def _over_memory(self, size: int, too_big: set[int], peak: int, measured: bool = False) -> None:
        """``size`` and every larger one are left out: a call at it takes (or, ``measured``, took) the process tree to
        ``peak`` bytes, over the limit."""
        too_big.update(s for s in self.sizes if s >= size)
        gib = 2**30
        self.figures.memory_limited = (
            f"{size} px and larger left out: one step at {size} px {'took' if measured else 'would take'} the process "
            f"tree to {peak / gib:.2f} GiB, over the {(self.memory_limit or memory.BOUND) / gib:.2f} GiB the run keeps to "
            "(streaming engine, --low-disk)")
        log.info("grid: %s", self.figures.memory_limited)

    def _chosen(self, choice: budget.Choice) -> None:
        f = self.figures
        f.size, f.steps, f.estimate_s, self.prompts = choice.size, choice.steps, round(choice.estimate_s, 1), choice.prompts
        if choice.prompts < len(f.prompts):
            f.cut = (f"{choice.prompts} of {len(f.prompts)} prompts: no more pairs fit --eval-budget even at "
                     f"{choice.size} px and {choice.steps} steps")
        log.info("grid: %d prompt%s at %d px, %d steps (estimated %.0f s for both pipelines; --eval-budget %.0f s, %.0f s "
                 "left)", choice.prompts, "s" if choice.prompts > 1 else "", choice.size, choice.steps, choice.estimate_s,
                 self.deadline.budget_s, self.deadline.left())

    def _no_grid(self, model: Model) -> None:
        smallest = 2 * model.per_image(self.sizes[-1], self.steps[-1]) + self.load_s
        self.figures.estimate_s = round(smallest, 1)
        self.figures.reason = (f"one pair of images at {self.sizes[-1]}x{self.sizes[-1]} px with {self.steps[-1]} steps "
                               f"would take about {smallest:.0f} s here, more than the {self.deadline.left():.0f} s left "
                               f"of --eval-budget {self.deadline.budget_s:.0f} s; raise --eval-budget, or publish on "
                               "a GPU (--on-hf-jobs FLAVOR)")
        log.warning("no comparison grid: %s", self.figures.reason)

    def _base_images(self, pipe: Any, timer: Timer, model: Model) -> None:
        f = self.figures
        for i in range(len(f.prompts)):
            if i >= self.prompts:
                break
            with memory.Watch(f.size) as used, timer.call() as call:
                self.base_images.append(image(pipe, f.prompts[i], f.seeds[i], f.size, f.steps, self.device))
            f.peak_rss_bytes = max(f.peak_rss_bytes, used.peak)
            self.base_times.append(call.seconds)
            self._progress("base", i, call.seconds)
            # re-plan: the rest of the base images and every quantized one must still fit
            per = max(self.base_times)
            while self.prompts > i + 1 and ((self.prompts - i - 1) * per + self.prompts * FIRST_SLOWER * per
                                            + self.load_s) > budget.SAFETY * self.deadline.left():
                self.prompts -= 1
                f.cut = f"{self.prompts} of {len(f.prompts)} prompts: the rest did not fit --eval-budget"
        self.prompts = min(self.prompts, len(self.base_images))

    # ---------------------------------------------------------------- the base, once per run
    def reference(self, recipe: str) -> GridReference:
        """What the base's part of this grid decided and made, for the run's next recipes."""
        f = self.figures
        return GridReference(recipe, f.size, f.steps, self.prompts, list(self.base_images[:self.prompts]),
                             list(self.base_times[:self.prompts]), self.load_s, list(f.probes), f.estimate_s, f.cut,
                             f.memory_limited, f.peak_rss_bytes)

    def reuse(self, reference: GridReference) -> None:
        """The base's part made by an earlier recipe of the run: its size, steps and images (the pairs compare
        with the same base images), the quantized images planned from its times."""
        f = self.figures
        f.size, f.steps, f.estimate_s, f.cut = reference.size, reference.steps, reference.estimate_s, reference.cut
        f.probes, f.memory_limited = list(reference.probes), reference.memory_limited
        f.peak_rss_bytes = reference.peak_rss_bytes
        self.prompts = reference.prompts
        self.base_images, self.base_times = list(reference.images), list(reference.times)
        log.info("grid: the bf16 base's %d image%s (%d px, %d steps) reused (computed once per run, for %s); "
                 "%.0f s of --eval-budget left for the quantized pipeline", self.prompts, "s" if self.prompts > 1 else "",
                 f.size, f.steps, reference.recipe, self.deadline.left())

    # ---------------------------------------------------------------- quantized
    def quantized(self, pipe: Any) -> None:
        f = self.figures
        try:
            with Timer(pipe, getattr(pipe, self.denoiser), self.deadline) as timer:
                for i in range(self.prompts):
                    per = max(self.quantized_times or [FIRST_SLOWER * max(self.base_times)])
                    if i > 0 and per > self.deadline.left():
                        self._cut(i, "the next image would not fit --eval-budget")
                        break
                    with memory.Watch(f.size) as used, timer.call() as call:
                        self.quantized_images.append(image(pipe, f.prompts[i], f.seeds[i], f.size, f.steps, self.device))
                        # the pair's figures are part of its time (SSIM at 512 px: about half a second here)
                        f.psnr.append(images.psnr(self.base_images[i], self.quantized_images[i]))
                        f.ssim.append(images.ssim(self.base_images[i], self.quantized_images[i]))
                    f.peak_rss_bytes = max(f.peak_rss_bytes, used.peak)
                    self.quantized_times.append(call.seconds)
                    self._progress("quantized", i, call.seconds)
        except OutOfTime as exc:
            self._stopped(str(exc), "quantized")

    # ---------------------------------------------------------------- results
    def pairs(self) -> list[tuple[Any, Any]]:
        """(base, quantized) images of every finished prompt (their PSNR and SSIM are in the figures)."""
        return list(zip(self.base_images, self.quantized_images))

    def _progress(self, role: str, i: int, seconds: float) -> None:
        log.info("grid: %s image %d of %d (%d px, %d steps): %.1f s; %.0f s of --eval-budget left", role, i + 1,
                 self.prompts, self.figures.size, self.figures.steps, seconds, max(self.deadline.left(), 0.0))

    def _cut(self, done: int, why: str) -> None:
        self.figures.cut = f"{done} of {len(self.figures.prompts)} prompts: {why}"
        log.warning("grid: %s", self.figures.cut)

    def _stopped(self, why: str, role: str) -> None:
        done = len(self.quantized_images) if role == "quantized" else len(self.base_images)
        if role == "base" and not self.prompts:  # ran out while timing: nothing was chosen
            self.figures.reason = f"{why} (while timing the pipeline); raise --eval-budget, or publish on a GPU"
            log.warning("no comparison grid: %s", self.figures.reason)
            return
        self.prompts = min(self.prompts, done)
        self._cut(done, f"{why} (in {role} image {done + 1})")
