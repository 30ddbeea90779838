"""The evaluation's time budget, kept: a deadline every step checks, and a timing model of the pipeline built from
real calls, so the grid's size and steps are chosen from what this machine measured, not from a rule of thumb.

    deadline = Deadline(budget_s)                  # starts now
    with Timer(pipe, deadline) as timer:           # hooks on the denoiser and the VAE's decode
        pipe(prompt=..., num_inference_steps=1, height=64, width=64)   # a probe: one step, one decode
    model = Model.fit(timer.calls)                 # seconds per step and per decode, by tokens and latent pixels
    choice = choose(model, deadline.left(), ...)   # the largest size, then the most steps, that fit

The denoiser's cost per call is fitted as ``a*T + b*T**2`` over the tokens ``T`` it saw (image and text tokens, read
from its inputs: the pipeline's own geometry, VAE factor and patch size included), so attention's square is counted;
the decode's as ``c*P + e*P**2`` over the latent's pixels (the VAE's mid-block attends over them). Two probes (64 and
128 px) fit both; a candidate size is then timed once for real before it is chosen. Every denoiser step and every
decode first checks the deadline, so a run that the model misjudged still stops within one step of the budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

SAFETY = 0.85  # the share of the time left that a plan may fill (timings on a busy machine vary by 10-20%)
PROBE_SHARE = 0.25  # a probe runs only when its predicted time is at most this share of the time left


class OutOfTime(Exception):
    """The budget ran out inside a pipeline call (raised by the deadline check of a step or a decode)."""


@dataclass
class Deadline:
    budget_s: float
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def check(self, what: str) -> None:
        if self.left() <= 0:
            raise OutOfTime(f"--eval-budget ({self.budget_s:.0f} s) ran out before {what}")


@dataclass
class Call:
    """One pipeline call as the hooks saw it: the denoiser's calls (tokens, seconds), the decodes (latent pixels,
    seconds) and the call's whole time."""

    steps: list[tuple[int, float]] = field(default_factory=list)
    decodes: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def other(self) -> float:
        """What is neither a step nor a decode (text encoders, scheduler, image conversion)."""
        return max(0.0, self.seconds - sum(s for _, s in self.steps) - sum(s for _, s in self.decodes))


def tokens_of(args: Sequence[Any], kwargs: dict[str, Any]) -> int:
    """The tokens a denoiser call attends over: its latent's positions (``[B, T, C]`` sequences, ``[B, C, H, W]``
    images, ``[B, C, F, H, W]`` videos) plus the text's (``encoder_hidden_states``)."""
    latent = kwargs.get("hidden_states", kwargs.get("sample", args[0] if args else None))
    text = kwargs.get("encoder_hidden_states")
    count = 0
    shape = tuple(getattr(latent, "shape", ()))
    if len(shape) == 3:
        count = shape[1]
    elif len(shape) >= 4:
        count = math.prod(shape[2:])
    text_shape = tuple(getattr(text, "shape", ()))
    if len(text_shape) == 3:
        count += text_shape[1]
    return max(count, 1)


class Timer:
    """Hooks that time every denoiser call and decode of a pipeline, and check the deadline before each."""

    def __init__(self, pipe: Any, denoiser: Any, deadline: Deadline) -> None:
        self.pipe, self.denoiser, self.deadline = pipe, denoiser, deadline
        self.calls: list[Call] = []
        self._handles: list[Any] = []
        self._started = 0.0
        self._tokens = 0

    def __enter__(self) -> Timer:
        def before(module: Any, args: Any, kwargs: Any) -> None:
            self.deadline.check("the next denoising step")
            self._tokens = tokens_of(args, kwargs)
            self._started = time.perf_counter()

        def after(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            self.current.steps.append((self._tokens, time.perf_counter() - self._started))

        self._handles = [self.denoiser.register_forward_pre_hook(before, with_kwargs=True),
                         self.denoiser.register_forward_hook(after, with_kwargs=True)]
        vae = getattr(self.pipe, "vae", None)
        if vae is not None and hasattr(vae, "decode"):
            decode = vae.decode

            def timed_decode(latents: Any, *args: Any, **kwargs: Any) -> Any:
                self.deadline.check("the decode of the next image")
                started = time.perf_counter()
                out = decode(latents, *args, **kwargs)
                pixels = math.prod(latents.shape[-2:]) * (latents.shape[2] if latents.ndim == 5 else 1)
                self.current.decodes.append((pixels, time.perf_counter() - started))
                return out

            self._handles.append(_Restore(vae, "decode"))  # before the override: what the instance had is kept
            vae.decode = timed_decode  # an instance attribute: the class's method is untouched
        return self

    @property
    def current(self) -> Call:
        if not self.calls:
            self.calls.append(Call())
        return self.calls[-1]

    @contextmanager
    def call(self) -> Iterator[Call]:
        """Time one pipeline call (its steps and decodes land in the yielded Call)."""
        record = Call()
        self.calls.append(record)
        started = time.perf_counter()
        try:
            yield record
        finally:
            record.seconds = time.perf_counter() - started

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _Restore:
    """Puts an instance attribute back as it was (absent, or the one a library's hooks had set)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.obj, self.name = obj, name
        self.had = name in obj.__dict__
        self.old = obj.__dict__.get(name)

    def remove(self) -> None:
        if self.had:
            self.obj.__dict__[self.name] = self.old
        else:
            self.obj.__dict__.pop(self.name, None)


def _fit(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of ``a*x + b*x**2`` through the measured points: exact for the two largest distinct x, conservative when
    the timings contradict the model (a negative term becomes zero and the other takes the slowest point's rate)."""
    by_x: dict[int, float] = {}
    for x, s in points:
        by_x[x] = s  # the latest of repeated measurements: an earlier one may hold the first call's one-time work
    xs = sorted(by_x)
    if not xs:
        return 0.0, 0.0
    if len(xs) == 1:
        x = xs[0]
        return by_x[x] / x, 0.0  # one size: nothing to extrapolate to (only this size or smaller is chosen)
    x0, x1 = xs[-2], xs[-1]
    t0, t1 = by_x[x0], by_x[x1]
    b = (t1 / x1 - t0 / x0) / (x1 - x0)
    a = t0 / x0 - b * x0
    if b < 0:
        return max(t0 / x0, t1 / x1), 0.0
    if a < 0:
        return 0.0, max(t0 / x0**2, t1 / x1**2)
    return a, b


@dataclass
class Model:
    """Seconds per image at a size, from the probes: ``other + steps * step(T) + decode(P)``, where the tokens ``T``
    and latent pixels ``P`` grow with the square of the size from what the probes saw."""

    step: tuple[float, float]
    decode: tuple[float, float]
    other: float
    text_tokens: int  # tokens that do not grow with the size (read as the constant part of T)
    image_tokens_per_px2: float
    latent_px_per_px2: float
    sizes: tuple[int, ...]  # the sizes measured

    @classmethod
    def fit(cls, probes: Sequence[tuple[int, Call]]) -> Model:
        """``probes``: (size in px, its call) for one or more sizes."""
        steps = [p for _, c in probes for p in c.steps]
        decodes = [p for _, c in probes for p in c.decodes]
        # the tokens at each size, from the denoiser's own inputs: text + k * size**2
        sized = sorted({(size, c.steps[0][0]) for size, c in probes if c.steps})
        if len(sized) >= 2 and sized[-1][0] != sized[0][0]:
            (s0, n0), (s1, n1) = sized[0], sized[-1]
            per_px2 = max((n1 - n0) / (s1 * s1 - s0 * s0), 0.0)
            text = max(0, round(n0 - per_px2 * s0 * s0))
        else:
            size, n = sized[0] if sized else (1, 1)
            per_px2, text = n / (size * size), 0
        latent = [(size, c.decodes[0][0]) for size, c in probes if c.decodes]
        latent_per_px2 = max(px / (size * size) for size, px in latent) if latent else 0.0
        return cls(_fit(steps), _fit(decodes), max((c.other for _, c in probes[1:] or probes), default=0.0), text, per_px2,
                   latent_per_px2, tuple(sorted({size for size, _ in probes})))

    def tokens(self, size: int) -> int:
        return max(1, round(self.text_tokens + self.image_tokens_per_px2 * size * size))

    def per_image(self, size: int, steps: int) -> float:
        t, p = self.tokens(size), self.latent_px_per_px2 * size * size
        a, b = self.step
        c, e = self.decode
        return self.other + steps * (a * t + b * t * t) + (c * p + e * p * p)


@dataclass(frozen=True)
class Choice:
    size: int
    steps: int
    prompts: int
    estimate_s: float  # the images of both pipelines and the second pipeline's load


def choose(model: Model, left_s: float, sizes: Sequence[int], steps: Sequence[int], prompts: int,
           slower: float, load_s: float) -> Choice | None:
    """The largest size, then the most steps, at which ``prompts`` pairs of images (the base's, then the quantized
    pipeline's at ``slower`` times the base's time, after ``load_s`` to load it) fit in ``SAFETY`` of ``left_s``; with
    fewer prompts only at the smallest size and steps. None when not even one pair fits."""
    room = SAFETY * left_s
    for size in sizes:
        for n_steps in steps:
            need = prompts * (1 + slower) * model.per_image(size, n_steps) + load_s
            if need <= room:
                return Choice(size, n_steps, prompts, need)
    size, n_steps = sizes[-1], steps[-1]
    for n in range(prompts - 1, 0, -1):
        need = n * (1 + slower) * model.per_image(size, n_steps) + load_s
        if need <= room:
            return Choice(size, n_steps, n, need)
    return None
