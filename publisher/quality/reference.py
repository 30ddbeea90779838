"""The bf16 base's side of the evaluation, made once per run and read by its next recipes.

Every recipe of a run compares its model with the same base: the same weights (read with the same cast), the same
evaluation windows, prompts and seeds. What the base gives there does not depend on the recipe, so the first recipe
that needs it computes it and the next ones read it: the per-window NLL of the perplexity after the pass, the greedy
continuation's new tokens, the grid's base images at the size and steps the first grid chose. A reused reference
costs no time, so the next recipe's ``--eval-budget`` goes to its own model. Each is keyed by what decides it; a key
that differs (a recipe whose quantized layers change how the base is cast) computes it again.

The perplexity measured during the quantization pass (``verify/inpass.py``) is not kept: the observer runs the base's
forward beside the quantized one as the pass reads each block, so it reads nothing more for it.

    refs = References()
    refs.nll(key, i) / refs.keep_nll(key, i, nll, recipe)          # perplexity after the pass, per window
    continuation(figures, ...)                                      # the greedy continuation, base read or reused
    refs.grid(key) / refs.keep_grid(key, GridReference(...))        # the grid's base images
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from publisher.quality import lm
from publisher.quality.budget import Deadline
from publisher.quality.sources import Weights

log = logging.getLogger(__name__)


@dataclass
class GridReference:
    """The base pipeline's part of a grid: what its timing calls chose and the images it made."""

    recipe: str  # the recipe whose run made them
    size: int
    steps: int
    prompts: int  # how many prompts the plan ran
    images: list[Any]
    times: list[float]  # seconds per base image
    load_s: float  # what opening the base pipeline took
    probes: list[dict[str, float]] = field(default_factory=list)
    estimate_s: float | None = None
    cut: str = ""
    memory_limited: str = ""
    peak_rss_bytes: int = 0


@dataclass
class _Greedy:
    recipe: str
    asked: int  # the new tokens it was asked for
    rows: list[list[int]]
    complete: bool  # it made every token asked (not cut by the budget)

    def covers(self, tokens: int) -> bool:
        return tokens <= self.asked and (self.complete or min(len(r) for r in self.rows) >= tokens)


class References:
    """One run's base-model references, keyed by what decides each."""

    def __init__(self) -> None:
        self._nll: dict[tuple[Any, ...], tuple[Any, str]] = {}
        self._greedy: dict[tuple[Any, ...], _Greedy] = {}
        self._grids: dict[tuple[Any, ...], GridReference] = {}

    def nll(self, key: tuple[Any, ...], window: int) -> tuple[Any, str] | None:
        """The base's NLL of ``window`` and the recipe that computed it, when one did."""
        return self._nll.get((*key, window))

    def keep_nll(self, key: tuple[Any, ...], window: int, nll: Any, recipe: str) -> None:
        self._nll[(*key, window)] = (nll, recipe)

    def grid(self, key: tuple[Any, ...]) -> GridReference | None:
        return self._grids.get(key)

    def keep_grid(self, key: tuple[Any, ...], reference: GridReference) -> None:
        if reference.images:  # a grid whose base made no image has nothing to give the next recipe
            self._grids[key] = reference


@dataclass
class Step:
    """What one generation step costs here: the reads of a model's weights, and its compute for every prompt."""

    base_read_s: float
    quantized_read_s: float
    compute_s: float  # one model, every prompt


def continuation(figures: lm.LmFigures, refs: References, key: tuple[Any, ...], recipe: str,
                 models: tuple[Weights, Weights], loader: tuple[str, str, dict[str, Any]], configs: Any,
                 step: Step, deadline: Deadline, budget_s: float) -> None:
    """The greedy continuation of ``figures.prompts`` by the base and the quantized model (``models``), the base's
    read from ``refs`` when an earlier recipe made at least as many tokens. ``loader``: library, class, config."""
    base_w, quant_w = models
    library, class_name, config = loader
    rkey = (*key, tuple(figures.prompts))
    cached = refs._greedy.get(rkey)
    quant_step = step.quantized_read_s + step.compute_s
    alone = min(lm.NEW_TOKENS, int(deadline.left() / quant_step) - 1 if quant_step > 0 else lm.NEW_TOKENS)
    reuse = cached is not None and alone >= 4 and cached.covers(alone)
    per_step = quant_step if reuse else step.base_read_s + quant_step + step.compute_s
    affordable = int(deadline.left() / per_step) - 1 if per_step > 0 else lm.NEW_TOKENS
    figures.new_tokens = min(lm.NEW_TOKENS, affordable)
    if figures.new_tokens < 4:
        figures.new_tokens = 0
        figures.continuation_reason = (f"a greedy continuation reads the weights once per new token (about "
                                       f"{per_step:.0f} s a token here, base and quantized), which the "
                                       f"{max(deadline.left(), 0):.0f} s left of --eval-budget ({budget_s:.0f} s) "
                                       "do not allow for 4 tokens")
        return
    began = time.monotonic()

    # each model gets half of what is left, checked after every token; both texts are cut to the shorter one
    def lines(role: str) -> Callable[[int], None]:
        started = time.monotonic()

        def each(n: int) -> None:
            log.info("continuation: %s model, token %d of %d (%d prompts): %.1f s; %.0f s of --eval-budget left", role,
                     n, figures.new_tokens, len(figures.prompts), time.monotonic() - started, max(deadline.left(), 0.0))
        return each

    if reuse and cached is not None:
        base = [row[:figures.new_tokens] for row in cached.rows]
        log.info("continuation: the bf16 base's %d new tokens reused (computed once per run, for %s)",
                 figures.new_tokens, cached.recipe)
    else:
        base = lm.greedy(base_w, library, class_name, config, configs, figures.prompts, figures.new_tokens,
                         max_time=max(deadline.left() / 2, 0.1), each_token=lines("base"))
        refs._greedy[rkey] = _Greedy(recipe, figures.new_tokens, base,
                                     complete=min(len(r) for r in base) >= figures.new_tokens)
    quant = lm.greedy(quant_w, library, class_name, config, configs, figures.prompts, figures.new_tokens,
                      max_time=max(deadline.left(), 0.1), each_token=lines("quantized"))
    made = min(min(len(r) for r in base), min(len(r) for r in quant))
    if made < figures.new_tokens:
        figures.continuation_limited = f"{made} of {figures.new_tokens} new tokens: --eval-budget ({budget_s:.0f} s) ran out"
        figures.new_tokens = made
    figures.base_text = lm.decode(configs, base, made)
    figures.quantized_text = lm.decode(configs, quant, made)
    figures.seconds["continuation"] = round(time.monotonic() - began, 3)
