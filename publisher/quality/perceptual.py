"""LPIPS (Zhang et al. 2018, "The Unreasonable Effectiveness of Deep Features as a Perceptual Metric"), version 0.1
with the AlexNet trunk: what ``lpips.LPIPS(net="alex")`` computes, the metric torchao's and the diffusers org's FLUX
comparisons lead with. 0 for equal images; lower is closer.

Its weights come from two places, and nothing is downloaded by this module:

- the **trunk**: torchvision's ImageNet AlexNet, the file ``torchvision.models.alexnet(weights="IMAGENET1K_V1")``
  downloads (``alexnet-owt-7be5be79.pth``, 233 MB), looked up where torch.hub keeps it (``$TORCH_HOME/hub/checkpoints``,
  ``~/.cache/torch/hub/checkpoints`` by default); only its five convolutions are read;
- the **linear layers** (five 1x1 convolutions, 6 KB): the ``lpips`` package's ``weights/v0.1/alex.pth``, found
  without importing the package (its import needs torchvision, whose PyPI build pins its own torch).

Why no download: the trunk is 233 MB from download.pytorch.org, a surprise inside a publish (and the tests may
download nothing); a machine that has run torchvision's AlexNet or lpips once has both files. When either is
missing, ``load()`` says which and how to get it, and the card says "LPIPS not computed: <why>".

The network is torchvision's ``AlexNet.features`` (conv 11x11/4 - ReLU - maxpool 3/2 - conv 5x5 - ReLU - maxpool - conv
3x3 - ReLU - conv 3x3 - ReLU - conv 3x3 - ReLU), written out here so that torchvision is not needed; a test runs the
``lpips`` package's own forward on the same weights and compares.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRUNK_FILE = "alexnet-owt-7be5be79.pth"  # torchvision's name (torch.hub checks the sha256 prefix in it on download)
TRUNK_URL = f"https://download.pytorch.org/models/{TRUNK_FILE}"
LINEAR_PATH = ("weights", "v0.1", "alex.pth")
CHANNELS = (64, 192, 384, 256, 256)
# torchvision's AlexNet.features: (index in the Sequential, in, out, kernel, stride, padding, max-pool before it)
CONVS = ((0, 3, 64, 11, 4, 2, False), (3, 64, 192, 5, 1, 2, True), (6, 192, 384, 3, 1, 1, True),
         (8, 384, 256, 3, 1, 1, False), (10, 256, 256, 3, 1, 1, False))
# lpips' ScalingLayer: inputs in [-1, 1] shifted and scaled to ImageNet's statistics
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
NAME = "LPIPS (v0.1, AlexNet)"
HOW_TO_GET = (f"pip install --no-deps lpips (its linear layers), and torchvision's AlexNet weights in "
              f"$TORCH_HOME/hub/checkpoints/{TRUNK_FILE} (python -c \"import torch; "
              f"torch.hub.load_state_dict_from_url('{TRUNK_URL}')\")")


class Unavailable(Exception):
    """The weights are not on this machine; the message says which and where they were looked for."""


@dataclass(frozen=True)
class Files:
    trunk: Path
    linear: Path


def trunk_path() -> Path:
    import torch

    return Path(torch.hub.get_dir()) / "checkpoints" / TRUNK_FILE


def linear_path() -> Path | None:
    """The lpips package's v0.1 AlexNet linear layers, located without importing the package (None: not installed)."""
    spec = importlib.util.find_spec("lpips")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder).joinpath(*LINEAR_PATH)
        if path.is_file():
            return path
    return None


def locate() -> Files:
    """Both weight files, or Unavailable naming what is missing and how to get it."""
    trunk, linear = trunk_path(), linear_path()
    missing = []
    if linear is None:
        missing.append("the lpips package's linear layers (pip install --no-deps lpips)")
    if not trunk.is_file():  # said as $TORCH_HOME's, not the resolved path: the reason goes into a published card
        missing.append(f"torchvision's AlexNet weights ($TORCH_HOME/hub/checkpoints/{TRUNK_FILE})")
    if missing:
        raise Unavailable(f"its weights were not found: {' and '.join(missing)}")
    assert linear is not None
    return Files(trunk, linear)


class Lpips:
    """The metric, built once from ``Files`` (float32 on the CPU: 2.5 M parameters, 10 MB)."""

    def __init__(self, files: Files) -> None:
        import torch

        trunk = _load(files.trunk)
        linear = _load(files.linear)
        try:
            self.convs = [(trunk[f"features.{i}.weight"].float(), trunk[f"features.{i}.bias"].float(), stride, pad, pool)
                          for i, _, _, _, stride, pad, pool in CONVS]
            self.lins = [linear[f"lin{k}.model.1.weight"].float() for k in range(len(CHANNELS))]
        except KeyError as exc:
            raise Unavailable(f"{files.trunk if 'features' in str(exc) else files.linear} lacks {exc}: not the "
                              "expected weights; delete it and get it again") from None
        for (w, _, _, _, _), (_, cin, cout, k, _, _, _) in zip(self.convs, CONVS):
            if tuple(w.shape) != (cout, cin, k, k):
                raise Unavailable(f"{files.trunk} holds a {tuple(w.shape)} convolution where AlexNet has {(cout, cin, k, k)}")
        self.shift = torch.tensor(SHIFT).view(1, 3, 1, 1)
        self.scale = torch.tensor(SCALE).view(1, 3, 1, 1)

    def features(self, x: Any) -> list[Any]:
        """The five ReLU outputs lpips compares (``relu1`` .. ``relu5``)."""
        import torch.nn.functional as F

        out = []
        h = (x - self.shift) / self.scale
        for w, b, stride, pad, pool in self.convs:
            if pool:
                h = F.max_pool2d(h, kernel_size=3, stride=2)
            h = F.relu(F.conv2d(h, w, b, stride=stride, padding=pad))
            out.append(h)
        return out

    def __call__(self, a: Any, b: Any) -> float:
        """LPIPS of two 8-bit RGB images (PIL images or HxWx3 arrays) of the same size."""
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            fa, fb = self.features(_tensor(a)), self.features(_tensor(b))
            total = torch.zeros(())
            for x, y, lin in zip(fa, fb, self.lins):
                # lpips.normalize_tensor: unit length along the channels (eps 1e-10), squared difference, the linear
                # layer's weighted sum over channels, the mean over the positions
                x = x / (x.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
                y = y / (y.pow(2).sum(dim=1, keepdim=True).sqrt() + 1e-10)
                total = total + F.conv2d((x - y) ** 2, lin).mean()
        return float(total)


def load() -> Lpips:
    return Lpips(locate())


def _load(path: Path) -> dict[str, Any]:
    import torch

    try:  # torchvision's file is a zip-format checkpoint: mapped, only the convolutions' 10 MB are read
        return dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except RuntimeError:  # a legacy (non-zip) file cannot be mapped
        return dict(torch.load(path, map_location="cpu", weights_only=True))


def _tensor(img: Any) -> Any:
    """[1, 3, H, W] float32 in [-1, 1], as lpips takes images (``lpips.im2tensor``)."""
    import numpy as np
    import torch

    arr = np.asarray(img.convert("RGB") if hasattr(img, "convert") else img, dtype=np.float32)
    return torch.from_numpy(arr / 127.5 - 1.0).permute(2, 0, 1)[None].contiguous()
