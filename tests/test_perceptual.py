"""LPIPS (publisher/quality/perceptual.py): found where torch.hub keeps torchvision's AlexNet and where the lpips package
keeps its linear layers, said plainly when either is missing, and equal to the lpips package's own forward.

No test downloads anything: the trunk is a seeded random AlexNet placed in the session's TORCH_HOME (conftest), the
way a user's earlier torchvision download would sit there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from publisher.quality import perceptual
from publisher.testing.evaldata import place_lpips_trunk


@pytest.fixture
def torch_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    return home


def _images(size: int = 96) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    b = np.clip(a.astype(int) + rng.integers(-40, 40, a.shape), 0, 255).astype(np.uint8)
    return a, b


def test_without_the_trunk_the_error_names_the_file_and_where_it_was_looked_for(torch_home: Path) -> None:
    with pytest.raises(perceptual.Unavailable) as exc:
        perceptual.load()
    assert f"torchvision's AlexNet weights ($TORCH_HOME/hub/checkpoints/{perceptual.TRUNK_FILE})" in str(exc.value)
    assert str(torch_home) not in str(exc.value)  # the reason goes into a published card: no local path
    assert perceptual.trunk_path() == torch_home / "hub" / "checkpoints" / perceptual.TRUNK_FILE  # where it looks


def test_without_the_lpips_package_the_error_says_how_to_install_it(torch_home: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    place_lpips_trunk(torch_home)
    monkeypatch.setattr(perceptual, "linear_path", lambda: None)
    with pytest.raises(perceptual.Unavailable, match=r"pip install --no-deps lpips"):
        perceptual.load()


def test_a_file_of_other_shapes_is_refused_by_name(torch_home: Path) -> None:
    import torch

    path = place_lpips_trunk(torch_home)
    state = torch.load(path, weights_only=True)
    state["features.3.weight"] = torch.zeros(10, 64, 5, 5)
    torch.save(state, path)
    with pytest.raises(perceptual.Unavailable, match="convolution where AlexNet has"):
        perceptual.load()


def test_with_the_trunk_in_place_equal_images_score_zero_and_different_ones_more(torch_home: Path) -> None:
    place_lpips_trunk(torch_home)
    metric = perceptual.load()
    a, b = _images()
    assert metric(a, a) == 0.0
    assert metric(a, b) > 0.0
    assert metric(a, b) == pytest.approx(metric(b, a), rel=1e-6)


# The lpips package's own forward on the same weights. Its import needs torchvision (for the AlexNet architecture) and
# scipy (unused by the forward), neither of which this environment has: the child process gives it both as small
# stand-ins, torchvision's AlexNet.features written out as torchvision defines it, loaded from the placed file.
REFERENCE = textwrap.dedent('''
    import json, sys, types
    import numpy as np
    import torch
    from torch import nn

    trunk_path, images_path = sys.argv[1], sys.argv[2]

    def alexnet(pretrained=True, **kwargs):
        model = types.SimpleNamespace()
        model.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))
        state = torch.load(trunk_path, weights_only=True)
        model.features.load_state_dict({k.removeprefix("features."): v for k, v in state.items()})
        return model

    tv = types.ModuleType("torchvision")
    tv.models = types.ModuleType("torchvision.models")
    tv.models.alexnet = alexnet
    sys.modules.update({"torchvision": tv, "torchvision.models": tv.models})
    scipy = types.ModuleType("scipy")
    scipy.ndimage = types.ModuleType("scipy.ndimage")
    scipy.ndimage.zoom = None
    sys.modules.update({"scipy": scipy, "scipy.ndimage": scipy.ndimage})

    import lpips

    model = lpips.LPIPS(net="alex", version="0.1", verbose=False)
    pairs = np.load(images_path)
    with torch.no_grad():
        out = [float(model(lpips.im2tensor(a), lpips.im2tensor(b))) for a, b in zip(pairs["a"], pairs["b"])]
    print(json.dumps(out))
''')


def test_equals_the_lpips_package_on_the_same_weights(torch_home: Path, tmp_path: Path) -> None:
    trunk = place_lpips_trunk(torch_home, seed=3)
    pairs = [_images(64), _images(200)]
    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs]
    # two sizes: AlexNet's pooling floors odd sizes, and 200 px gives other shapes than 64
    results = []
    for x, y in zip(a, b):
        np.savez(tmp_path / "images.npz", a=x[None], b=y[None])
        done = subprocess.run([sys.executable, "-c", REFERENCE, str(trunk), str(tmp_path / "images.npz")],
                              capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1])[0])
    metric = perceptual.load()
    ours = [metric(x, y) for x, y in zip(a, b)]
    assert ours == pytest.approx(results, rel=1e-5, abs=1e-7)
    assert all(r > 0 for r in results)
