"""Image figures: PSNR and SSIM of a quantized image against the base's, and the comparison grid as one PNG.

SSIM is Wang et al.'s (2004): an 11x11 Gaussian window with sigma 1.5, K1 = 0.01, K2 = 0.03, on 8-bit values
(data range 255), the mean over the three channels: what ``skimage.metrics.structural_similarity(a, b,
channel_axis=2, gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255)`` computes, here
with torch's conv2d so that no image library is needed. LPIPS needs a network's weights (AlexNet or VGG plus its
linear layers), which cannot be had offline, so it is not computed; the card says which metrics were.
"""

from __future__ import annotations

import math
from typing import Any

METRICS_NOTE = ("PSNR and SSIM against the base's image; LPIPS was not computed (it needs a network's weights, which "
                "this run could not download)")


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
    window = (g[:, None] * g[None, :])[None, None]

    def blur(t: Any) -> Any:
        return torch.nn.functional.conv2d(t, window)  # "valid" region only, as skimage crops its borders

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean(dim=(1, 2, 3)).mean())


def grid(rows: list[tuple[Any, Any]]) -> Any:
    """One image: a row per prompt, the base's image on the left and the quantized one on the right, no margins (so
    its size is 2 x width by rows x height)."""
    from PIL import Image

    width, height = rows[0][0].size
    canvas = Image.new("RGB", (2 * width, len(rows) * height), "white")
    for i, (base, quantized) in enumerate(rows):
        canvas.paste(base.convert("RGB"), (0, i * height))
        canvas.paste(quantized.convert("RGB"), (width, i * height))
    return canvas
