"""What the user asked of the quality evaluation, as data: the text dataset (``--eval-dataset``), the bounds of the
quality gate (``--min-quality``) and which figures apply to which model. Parsed and checked before any download.

The figures themselves are computed by ``lm.py`` (language models) and ``grid.py`` (pipelines); ``gate()`` compares
them with the bounds after the evaluation and before anything is pushed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from publisher.errors import QualityError, UsageError

DEFAULT_DATASET = "Salesforce/wikitext:wikitext-2-raw-v1:test"  # wikitext-2-raw's test split, as the Hub stores it
DEFAULT_TOKENS = 1024
DEFAULT_BUDGET = "auto"
BUDGET_VARIABLE = "HF_AO_PUBLISH_EVAL_BUDGET"  # --eval-budget from the environment
# --eval-budget auto: AUTO_FLOOR_S plus a second per AUTO_BYTES_PER_S bytes of the weights the evaluation runs (bf16),
# at most AUTO_CEILING_S. A hard bound either way (the evaluation stops when it is spent); auto scales it with the model
# so that a model of a few MB is evaluated in seconds and a stock CPU runner never spends more than ten minutes on it
# (docs/quality.md, "The budget").
AUTO_FLOOR_S = 5.0
AUTO_BYTES_PER_S = 20_000_000
AUTO_CEILING_S = 600.0
BUDGET_HELP = ("Time each recipe's quality evaluation may take, a hard bound (e.g. 90s, 5m, 600): it decides the grid's "
               "size and steps, the continuation's length and the perplexity windows, and stops them when spent. auto: "
               f"{AUTO_FLOOR_S:.0f} s plus 1 s per {AUTO_BYTES_PER_S // 1_000_000} MB of the weights evaluated, at most "
               f"{AUTO_CEILING_S / 60:.0f} min. 0 turns the evaluation off.")
FULL_IMAGES_HELP = ("Also put each grid image at its full size in the repo (quality/*.png, lossless; the card's grid is "
                    "a labelled JPEG of at most 2 MB).")
CAUSAL_LM = "causal language model"
PIPELINE = "pipeline"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # the models it applies to: CAUSAL_LM or PIPELINE
    unit: str
    what: str  # for messages and the card
    lower_is_better: bool = False  # LPIPS: a distance, the bound is a maximum


METRICS = {m.name: m for m in (
    Metric("ppl-recovery", CAUSAL_LM, "%", "base perplexity / quantized perplexity on the evaluation text, in percent"),
    Metric("psnr", PIPELINE, " dB", "PSNR of each quantized grid image against the base's (the lowest counts)"),
    Metric("ssim", PIPELINE, "", "SSIM of each quantized grid image against the base's (the lowest counts)"),
    Metric("lpips", PIPELINE, "", "LPIPS (v0.1, AlexNet) of each quantized grid image against the base's, at most VALUE "
           "(the highest counts; needs its weights, docs/quality.md)", lower_is_better=True),
)}


@dataclass(frozen=True)
class DatasetSpec:
    """``REPO[:CONFIG][:SPLIT]``: a Hub dataset repo, its config (subset) and split, as ``datasets.load_dataset`` takes
    them."""

    repo: str
    config: str | None = None
    split: str = "test"

    @classmethod
    def parse(cls, text: str) -> DatasetSpec:
        parts = text.strip().split(":")
        if len(parts) > 3 or not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", parts[0]) or any(not p for p in parts[1:]):
            raise ValueError(f"{text!r} is not REPO[:CONFIG][:SPLIT] (e.g. {DEFAULT_DATASET})")
        return cls(parts[0], parts[1] if len(parts) > 1 else None, parts[2] if len(parts) > 2 else "test")

    def text(self) -> str:
        return ":".join([self.repo, *([self.config] if self.config else []), self.split])


@dataclass(frozen=True)
class Bound:
    metric: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Bound:
        name, sep, value = text.partition("=")
        name = name.strip().lower()
        if not sep or name not in METRICS:
            raise ValueError(f"{text!r} is not METRIC=VALUE with METRIC one of {', '.join(METRICS)} (e.g. ppl-recovery=95)")
        try:
            number = float(value.strip().rstrip("%").removesuffix("dB").strip())
        except ValueError:
            raise ValueError(f"{text!r}: {value.strip()!r} is not a number") from None
        if not math.isfinite(number):
            raise ValueError(f"{text!r}: the bound must be a finite number")
        return cls(name, number)

    def text(self) -> str:
        return f"{self.metric}={self.value:g}"


@dataclass(frozen=True)
class Settings:
    """The evaluation's options, parsed (``settings``)."""

    dataset: DatasetSpec
    explicit_dataset: bool  # named with --eval-dataset: a dataset that cannot be read is an error
    tokens: int
    budget_s: float | None  # 0: no evaluation; None: auto (``budget_for``)
    bounds: tuple[Bound, ...]
    prompt: str | None  # --sample-prompt: the first prompt of the grid or the continuations
    size: int
    steps: int
    full_images: bool = False  # --eval-full-images: the grid's images at full size in the repo besides the JPEG

    @property
    def enabled(self) -> bool:
        return self.budget_s is None or self.budget_s > 0

    def budget_for(self, weight_bytes: int) -> float:
        """The hard time bound in seconds for an evaluation that runs ``weight_bytes`` of bf16 weights."""
        if self.budget_s is not None:
            return self.budget_s
        return min(AUTO_CEILING_S, AUTO_FLOOR_S + weight_bytes / AUTO_BYTES_PER_S)

    def budget_text(self) -> str:
        return "auto" if self.budget_s is None else f"{self.budget_s:g} s"

    def to_dict(self) -> dict[str, object]:
        return {"dataset": self.dataset.text(), "tokens": self.tokens,
                "budget_s": "auto" if self.budget_s is None else self.budget_s,
                "min_quality": [b.text() for b in self.bounds], "full_images": self.full_images}


def seconds(text: str) -> float | None:
    """'15m', '1h', '90s', '600' -> seconds; None when it is not a duration."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh]?)", text.strip().lower())
    if not match:
        return None
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def settings(dataset: str | None, tokens: int, budget: str, bounds: tuple[str, ...], prompt: str | None, size: int,
             steps: int, full_images: bool = False) -> Settings:
    """The CLI's options as ``Settings``; UsageError (exit 2) naming the option for anything malformed."""
    budget_s = None if budget.strip().lower() == "auto" else seconds(budget)
    if budget_s is None and budget.strip().lower() != "auto":
        raise UsageError(f"--eval-budget {budget!r} is not a duration such as 90s, 5m or 600, nor auto (0: no evaluation)")
    try:
        data = DatasetSpec.parse(dataset or DEFAULT_DATASET)
    except ValueError as exc:
        raise UsageError(f"--eval-dataset {exc}") from None
    try:
        parsed = tuple(Bound.parse(b) for b in bounds)
    except ValueError as exc:
        raise UsageError(f"--min-quality {exc}") from None
    if budget_s == 0 and (parsed or dataset or full_images):
        flag = "--min-quality" if parsed else "--eval-dataset" if dataset else "--eval-full-images"
        raise UsageError(f"{flag} needs the quality evaluation, which --eval-budget 0 turns off; drop one of them")
    return Settings(data, dataset is not None, tokens, budget_s, parsed, prompt, size, steps, full_images)


def model_kind(kind: str, class_name: str) -> str | None:
    """CAUSAL_LM, PIPELINE, or None (a transformers model without a language-model head: no figure applies)."""
    if kind == "pipeline":
        return PIPELINE
    return CAUSAL_LM if class_name.endswith(("ForCausalLM", "LMHeadModel")) else None


def check_applicable(bounds: tuple[Bound, ...], kind: str | None, what: str) -> None:
    """A bound on a figure this model does not have is a usage error (exit 2), raised before any download."""
    for bound in bounds:
        metric = METRICS[bound.metric]
        if metric.kind != kind:
            applicable = [m.name for m in METRICS.values() if m.kind == kind]
            raise UsageError(f"--min-quality {bound.text()}: {bound.metric} applies to a {metric.kind}, and {what} is "
                             f"{'a ' + kind if kind else 'neither'}; "
                             + (f"use {' or '.join(applicable)}" if applicable else "drop --min-quality for this model"))


def gate(bounds: tuple[Bound, ...], figures: dict[str, float | None], missing: dict[str, str], recipe: str) -> None:
    """QualityError (exit 1) naming the figure and the bound when a figure falls below its bound, or was not measured
    (``missing``: metric -> why)."""
    for bound in bounds:
        unit = METRICS[bound.metric].unit
        value = figures.get(bound.metric)
        if value is None:
            why = missing.get(bound.metric, "it was not measured")
            raise QualityError(f"{recipe}: --min-quality {bound.text()} cannot be checked: {bound.metric} was not measured "
                               f"({why}); nothing was pushed")
        worse = value > bound.value if METRICS[bound.metric].lower_is_better else value < bound.value
        if worse:
            side = "above" if METRICS[bound.metric].lower_is_better else "below"
            raise QualityError(f"{recipe}: {bound.metric} is {value:.4g}{unit}, {side} --min-quality {bound.text()}; "
                               "nothing was pushed")
