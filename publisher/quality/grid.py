"""Pipelines: a seeded comparison grid, base and quantized, at the size and steps the run can afford.

Fixed prompts (``--sample-prompt`` first when given), one seed each, the same for both pipelines; one image per
prompt and pipeline, compared by PSNR and SSIM (``images.py``), saved as one labelled JPEG in the repo.

How the pipelines run:

- **whole** (a CPU with memory for the whole bf16 pipeline and its files on disk): ``from_pretrained`` of the base
  folder, then of the quantized one, one pipeline in memory at a time;
- **offloaded** (otherwise, ``--low-disk`` included): every model component is built on the meta device; one small
  enough (``BLOCK_BUDGET``) is loaded whole, a larger one block by block as it runs (``verify/streaming.BlockLoader``,
  the verification's machinery), from the saved files, the local base, or the Hub by HTTP range; the quantized
  weights of a folder whose shards were uploaded and deleted are the base's quantized again as they are read;
- **GPU**: the whole pipeline on the GPU, or ``enable_model_cpu_offload()`` when it does not fit there.

The size and steps are chosen, and kept within ``--eval-budget``, by ``gridrun.py`` (with ``budget.py``'s timing of
real calls); when not even one pair of images fits, there is no grid and the card says what it would need.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publisher import adapters
from publisher.io.jsonfile import read_object
from publisher.quality.sources import Weights, load_whole
from publisher.streaming.shards import TensorReader, build_index
from publisher.verify import streaming as blockwise  # BLOCK_BUDGET read when a model is built (tests lower it)
from publisher.verify.streaming import BlockLoader, meta_model

log = logging.getLogger(__name__)

PROMPTS = ("a photo of a cat", "a red bicycle leaning against a brick wall", "a bowl of fruit on a wooden table")
IMAGE_NAME = "quality_grid.jpg"  # labelled, card-sized (images.grid): at most 2 MB
CPU_SIZES = (1024, 768, 512, 384, 256, 128, 64)
CPU_STEPS = (28, 8, 4, 2)
MIN_SIZE = 64  # SSIM's window needs 11 pixels; below 64 a picture says little


@dataclass
class GridFigures:
    """What the card and --json say about a pipeline's grid."""

    prompts: list[str]  # the prompts of the grid (those the budget allowed)
    seeds: list[int]
    image: str | None = None  # file name in the repo
    full_images: list[str] = field(default_factory=list)  # --eval-full-images: each image at full size (repo paths)
    size: int = 0
    steps: int = 0
    device: str = "cpu"
    mode: str = ""  # "whole pipeline in memory", "offloaded: ...", "GPU"
    psnr: list[float] = field(default_factory=list)
    ssim: list[float] = field(default_factory=list)
    lpips: list[float] = field(default_factory=list)  # LPIPS v0.1 AlexNet per image (perceptual.py); empty: not computed
    lpips_reason: str = ""  # why LPIPS was not computed
    metrics: str = ""
    estimate_s: float | None = None  # what the chosen grid was predicted to take (images and the second load)
    seconds: float = 0.0  # what the whole evaluation took (loads, timing calls and images)
    budget_s: float = 0.0  # --eval-budget, in seconds (auto resolved)
    asked: tuple[int, int] = (0, 0)  # --sample-size and --sample-steps: what a GPU with time to spare runs
    cut: str = ""  # what the budget cut from what was asked (prompts, size, steps), "" when nothing
    probes: list[dict[str, float]] = field(default_factory=list)  # the timing calls: size, seconds
    reason: str = ""  # why there is no grid
    memory_limited: str = ""  # the sizes left out to stay within the run's memory bound, and why ("" when none)
    peak_rss_bytes: int = 0  # the process tree's highest resident memory in the timing calls
    quantized_from: str = ""  # where the quantized weights were read


def lower_bound(denoiser_params: int, read_bytes: int, read_rate: float, flops: float) -> float:
    """Seconds that one one-step call at the smallest size takes at least: the offloaded denoiser's weights read once
    (``read_bytes``, 0 when it is in memory) and 2 FLOPs per denoiser parameter for each of 16 image tokens (64 px at
    the common 16x reduction of a VAE and a 2x2 patch; text tokens and attention left out, so it stays a bound) at this
    machine's measured bf16 matmul rate. Used to give up without running anything when even that is out of reach."""
    return read_bytes / max(read_rate, 1.0) + 2 * denoiser_params * 16 / max(flops, 1.0)


def measured_flops() -> float:
    """bf16 matmul FLOPs per second on this machine: a fifth of a second of 256x256 products (small, because a CPU
    without bf16 kernels, this project's, does about 1.5 GFLOP/s: one 1024x1024 product would take a second)."""
    import torch

    n, size = 0, 256
    a = torch.randn(size, size, dtype=torch.bfloat16)
    a @ a
    started = time.perf_counter()
    while n == 0 or time.perf_counter() - started < 0.2:
        a @ a
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - started)


def image(pipe: Any, prompt: str, seed: int, size: int, steps: int, device: str) -> Any:
    """One image of ``pipe``, seeded (the same generator for both pipelines)."""
    import torch

    out = pipe(prompt=prompt, num_inference_steps=steps, height=size, width=size,
               generator=torch.Generator("cpu" if device == "cpu" else device).manual_seed(seed))
    return out.images[0]


def quiet_loading() -> None:
    """diffusers draws a "Loading pipeline components" bar on stderr whatever HF_HUB_DISABLE_PROGRESS_BARS says; the
    run's own progress lines say what happens (a successful run prints no third-party lines)."""
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()


def whole(folder: Path, device: str) -> Any:
    import torch
    from diffusers import DiffusionPipeline

    quiet_loading()
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    if device == "cuda":
        import contextlib

        try:
            return pipe.to("cuda")
        except torch.OutOfMemoryError:
            with contextlib.suppress(Exception):
                pipe.to("cpu")
            torch.cuda.empty_cache()
            pipe.enable_model_cpu_offload()  # each component on the GPU only while it runs
    return pipe


class Offloaded:
    """A pipeline whose model components are meta-device models fed from ``Weights`` (see the module docstring); the
    block loaders stay attached (and their files open) until ``close()``."""

    def __init__(self, configs: Path, models: dict[str, tuple[str, str, Weights]]) -> None:
        self.configs, self.models = configs, models
        self.open: list[Any] = []

    def __enter__(self) -> Any:
        import torch
        from diffusers import DiffusionPipeline


        built: dict[str, Any] = {}
        for name, (library, class_name, weights) in self.models.items():
            model = meta_model(library, class_name, read_object(self.configs / name / "config.json"))
            size = sum(p.numel() * 2 for p in model.parameters())
            if size <= blockwise.BLOCK_BUDGET:
                built[name] = load_whole(model, weights, library)
                continue
            reader = TensorReader(weights.source, build_index(weights.source))
            loader = BlockLoader(model, reader, blockwise.BLOCK_BUDGET, weights.cast)
            loader.attach()
            self.open.append((loader, reader))
            built[name] = model.eval()
        quiet_loading()
        pipe = DiffusionPipeline.from_pretrained(self.configs, dtype=torch.bfloat16, **built)
        pipe.set_progress_bar_config(disable=True)
        cpu = torch.device("cpu")
        # The meta-device components would make the pipeline create its latents on "meta"; every input is made on
        # the CPU, where each block runs once it is loaded.
        pipe.__class__ = type(type(pipe).__name__, (type(pipe),), {"device": property(lambda self: cpu),
                                                                   "_execution_device": property(lambda self: cpu)})
        return pipe

    def __exit__(self, *exc: object) -> None:
        for loader, reader in self.open:
            loader.detach()
            reader.close()
        self.open.clear()
        gc.collect()


def loader_cast(library: str, class_name: str) -> Any:
    """``cast`` for an unquantized component read tensor by tensor: what ``from_pretrained(dtype=torch.bfloat16)``
    gives, bf16 floats except the modules the class keeps in float32 (the list its adapter's ``keep_fp32_attr``
    names)."""
    import torch

    cls = getattr(__import__(library), class_name, None)
    keep = list(getattr(cls, adapters.of(library).keep_fp32_attr, None) or [])

    def cast(name: str, t: Any) -> Any:
        if type(t) is not torch.Tensor or not t.is_floating_point():
            return t
        return t.to(torch.float32 if any(k in name.split(".") for k in keep) else torch.bfloat16)

    return cast
