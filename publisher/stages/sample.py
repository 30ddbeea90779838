"""Optional seeded generation with the base and the quantized pipeline, compared by PSNR and saved
as one side-by-side PNG in the repo (shown in the card). Pipelines only."""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

IMAGE_NAME = "sample_comparison.png"


@dataclass
class SampleResult:
    image: str  # file name in the repo folder
    psnr: float


def _generate(folder: Path, prompt: str, steps: int, size: int, seed: int, device: str) -> Any:
    import torch
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.bfloat16).to(device)
    image = pipe(prompt, num_inference_steps=steps, height=size, width=size,
                 generator=torch.Generator(device).manual_seed(seed)).images[0]
    del pipe
    gc.collect()
    return image


def psnr(a: Any, b: Any) -> float:
    import numpy as np

    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def compare_samples(base_dir: Path, quantized_dir: Path, prompt: str, steps: int, size: int, seed: int = 0,
                    device: str = "cpu") -> SampleResult:
    """Generate with each pipeline in turn (one in memory at a time), save base|quantized side by side."""
    from PIL import Image

    log.info("sample: %d steps at %dx%d with the base, then the quantized pipeline", steps, size, size)
    base = _generate(base_dir, prompt, steps, size, seed, device)
    quant = _generate(quantized_dir, prompt, steps, size, seed, device)
    canvas = Image.new("RGB", (base.width + quant.width, max(base.height, quant.height)), "white")
    canvas.paste(base, (0, 0))
    canvas.paste(quant, (base.width, 0))
    canvas.save(quantized_dir / IMAGE_NAME)
    return SampleResult(IMAGE_NAME, psnr(base, quant))
