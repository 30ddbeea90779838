"""Image figures: PSNR and SSIM of a quantized image against the base's, and the comparison grid as one labelled JPEG.

SSIM is Wang et al.'s (2004): an 11x11 Gaussian window with sigma 1.5, K1 = 0.01, K2 = 0.03, on 8-bit values
(data range 255), the mean over the three channels: what ``skimage.metrics.structural_similarity(a, b,
channel_axis=2, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255)`` computes, here
with torch's matrix products so that no image library is needed. LPIPS (``perceptual.py``) where its weights are on this
machine; the card says which metrics were computed, and why LPIPS was not.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher.quality import perceptual
from publisher.quality.budget import Deadline

if TYPE_CHECKING:  # types only
    from publisher.quality.grid import GridFigures

log = logging.getLogger(__name__)
FULL_FOLDER = "quality"  # --eval-full-images: the grid's images at full size, lossless

# LPIPS' AlexNet on a 1024 px pair: about 60 GFLOP in float32; planned at this rate until one pair is timed (this
# project's 2-core CPU ran a 1024 px pair in 0.6 s, about 100 GFLOP/s: the plan is 5x slower than that)
LPIPS_FLOPS_PER_PIXEL_PAIR = 60e9 / 1024**2
LPIPS_PLANNED_RATE = 20e9


def psnr(a: Any, b: Any) -> float:
    """Peak signal-to-noise ratio in dB of two 8-bit images (inf when they are equal)."""
    import numpy as np

    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def ssim(a: Any, b: Any) -> float:
    """Structural similarity of two 8-bit RGB (or grey) images of the same size, in [-1, 1] (1: equal)."""
    import numpy as np
    import torch

    def planes(img: Any) -> Any:
        arr = np.asarray(img, dtype=np.float64)
        arr = arr[..., None] if arr.ndim == 2 else arr
        return torch.from_numpy(arr).permute(2, 0, 1)[:, None]  # [C, 1, H, W]

    x, y = planes(a), planes(b)
    if x.shape != y.shape:
        raise ValueError(f"images differ in size: {tuple(x.shape)} and {tuple(y.shape)}")
    size, sigma = 11, 1.5
    if min(x.shape[-2:]) < size:
        raise ValueError(f"images of {tuple(x.shape[-2:])} pixels are smaller than SSIM's {size}x{size} window")
    g = torch.exp(-((torch.arange(size, dtype=torch.float64) - size // 2) ** 2) / (2 * sigma**2))
    g = g / g.sum()
    def band(n: int) -> Any:  # [n - size + 1, n]: row i holds the kernel at columns i .. i + size - 1
        m = torch.zeros(n - size + 1, n, dtype=torch.float64)
        for i in range(n - size + 1):
            m[i, i:i + size] = g
        return m

    left, right = band(x.shape[-2]), band(x.shape[-1]).T

    def blur(t: Any) -> Any:  # the 11x11 Gaussian as two 1-D passes, each a matrix product (BLAS: float64 convolution
        return left @ t @ right  # has no fast CPU kernel); the "valid" region only, as skimage crops its borders

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean(dim=(1, 2, 3)).mean())


CELL_MIN, CELL_MAX = 256, 512  # each image's side in the card's grid: small images enlarged, large ones reduced
MAX_BYTES = 2_000_000  # the grid's file at most (a card shows it inline; the full images are not kept)


def perceptual_figures(figures: GridFigures, pairs: list[tuple[Any, Any]], deadline: Deadline) -> None:
    """LPIPS of every pair into ``figures.lpips``, or why not into ``figures.lpips_reason``: its weights are not on this
    machine, or the pairs do not fit what is left of --eval-budget (all pairs or none, so that the figure the card and
    the gate read is the worst of all images)."""

    try:
        metric = perceptual.load()
    except perceptual.Unavailable as exc:
        figures.lpips_reason = str(exc)
        log.info("LPIPS not computed: %s (TORCH_HOME is %s); to compute it: %s", exc,
                 perceptual.trunk_path().parents[2], perceptual.HOW_TO_GET)
        return
    width, height = pairs[0][0].size
    per_pair = LPIPS_FLOPS_PER_PIXEL_PAIR * width * height / LPIPS_PLANNED_RATE
    values = []
    for i, (base, quantized) in enumerate(pairs):
        if (len(pairs) - i) * per_pair > deadline.left():
            figures.lpips_reason = (f"--eval-budget ({deadline.budget_s:.0f} s) ran out before the images' LPIPS "
                                    f"({len(pairs) - i} pair(s) at about {per_pair:.1f} s each)")
            log.warning("LPIPS not computed: %s", figures.lpips_reason)
            return
        started = time.monotonic()
        values.append(metric(base, quantized))
        per_pair = time.monotonic() - started
    figures.lpips = values
    log.info("grid: LPIPS of %d image%s: %s", len(values), "s" if len(values) > 1 else "",
             ", ".join(f"{v:.4f}" for v in values))


def metrics_note(figures: GridFigures) -> str:
    """Which metrics the card's figures are, for its text."""

    if figures.lpips:
        return f"PSNR, SSIM and {perceptual.NAME} against the base's image"
    return f"PSNR and SSIM against the base's image; LPIPS not computed: {figures.lpips_reason}"


def grid(rows: list[tuple[Any, Any]], figures: GridFigures, recipe: str) -> Any:
    """One labelled image for the card: column heads (the bf16 base, this repo), a row per prompt with the prompt
    under it, and each quantized image's PSNR, SSIM (and LPIPS) under it. Images are shown at 256-512 px (enlarged
    without smoothing, so a tiny test image stays a grid of pixels, or reduced)."""
    prompts, psnr_db, ssim_values = figures.prompts, figures.psnr, figures.ssim
    from PIL import Image, ImageDraw, ImageFont

    width, height = rows[0][0].size
    cell = min(CELL_MAX, max(CELL_MIN, width))
    scaled_h = round(height * cell / width)
    font = ImageFont.load_default(size=max(12, cell // 22))
    line = font.getbbox("Ag")[3] + 6
    pad = 8
    head = line + pad
    row_h = scaled_h + 2 * line + pad
    canvas = Image.new("RGB", (2 * cell + 3 * pad, head + len(rows) * row_h), "white")
    draw = ImageDraw.Draw(canvas)
    for col, title in enumerate(("bf16 base", f"this repo ({recipe})")):
        draw.text((pad + col * (cell + pad), pad // 2), _fit(draw, title, font, cell), fill="black", font=font)
    resample = Image.Resampling.NEAREST if cell >= width else Image.Resampling.LANCZOS
    for i, (base, quantized) in enumerate(rows):
        top = head + i * row_h
        for col, img in enumerate((base, quantized)):
            canvas.paste(img.convert("RGB").resize((cell, scaled_h), resample), (pad + col * (cell + pad), top))
        figure = "PSNR inf dB (identical)" if psnr_db[i] == float("inf") else f"PSNR {psnr_db[i]:.2f} dB, SSIM {ssim_values[i]:.4f}"
        if figures.lpips:
            figure += f", LPIPS {figures.lpips[i]:.4f}"
        draw.text((2 * pad + cell, top + scaled_h + 2), _fit(draw, figure, font, cell), fill="black", font=font)
        draw.text((pad, top + scaled_h + 2 + line), _fit(draw, f"{i + 1}. {prompts[i]}", font, 2 * cell + pad),
                  fill="dimgray", font=font)
    return canvas


def _fit(draw: Any, text: str, font: Any, width: int) -> str:
    """``text`` cut (with an ellipsis) to ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def save_grid(image: Any, path: Any) -> int:
    """Save as JPEG within MAX_BYTES (lower quality until it fits); returns the file's size."""
    for quality in (90, 80, 70, 55, 40):
        image.save(path, format="JPEG", quality=quality, optimize=True)
        size = path.stat().st_size
        if size <= MAX_BYTES:
            return size
    raise ValueError(f"the comparison grid is {size} bytes even at JPEG quality 40")  # a bug: 1,000 x 2,500 px is far less


def save_full(pairs: list[tuple[Any, Any]], folder: Path) -> list[str]:
    """--eval-full-images: each pair at its full size, lossless (``quality/prompt-1-base.png``,
    ``quality/prompt-1-quantized.png``, ...); returns the repo paths."""
    (folder / FULL_FOLDER).mkdir(exist_ok=True)
    names = []
    for i, pair in enumerate(pairs):
        for role, img in zip(("base", "quantized"), pair):
            name = f"{FULL_FOLDER}/prompt-{i + 1}-{role}.png"
            img.save(folder / name, format="PNG", optimize=True)
            names.append(name)
    return names
