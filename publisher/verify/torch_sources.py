"""Where a verification environment's torch comes from when a spec names one (``--compat 'torch==2.15.0'``).

On Linux, PyPI's torch is the CUDA build: about 0.5 GB for the wheel and several GB of CUDA libraries beside it, of
no use on a machine without CUDA. The CPU build is the same torch for the loads the matrix runs, a fraction of the
size, and lives on PyTorch's own index with a local version (``2.15.0+cpu``). So on a machine without CUDA, in order:

1. the user's configured sources (pip's config, ``PIP_INDEX_URL``, a mirror or a folder of wheels) asked for the CPU
   build by name (``torch==2.15.0+cpu``): a mirror that holds it needs no access to PyTorch's index;
2. PyTorch's CPU index (``HF_AO_PUBLISH_TORCH_CPU_INDEX``, default ``https://download.pytorch.org/whl/cpu``) as an
   extra index: PEP 440 sorts ``2.15.0+cpu`` after ``2.15.0``, so pip takes the CPU build for any spec;
3. the spec as written from the configured sources: on Linux that is PyPI's CUDA build, and the log says so first.

With CUDA (a driver present) the spec goes to the configured sources as written, as ``pip install`` would.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CPU_INDEX_VARIABLE = "HF_AO_PUBLISH_TORCH_CPU_INDEX"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
_EXACT = re.compile(r"^torch==(\d+(?:\.\d+)*)$")  # an exact release without a local version


@dataclass(frozen=True)
class Attempt:
    requirements: list[str]
    options: list[str]  # pip options for this attempt (an extra index)
    note: str  # the log line said before it ("" for none)


def cpu_index() -> str:
    return os.environ.get(CPU_INDEX_VARIABLE) or CPU_INDEX


def has_cuda() -> bool:
    """An NVIDIA driver on this machine (what a CUDA build of torch needs to use a GPU)."""
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def attempts(requirements: Sequence[str], cuda: bool | None = None, fallback: bool = True) -> list[Attempt]:
    """The pip installs to try, in order, for a spec that names torch (see the module's docstring); ``fallback``
    False: never the build the sources have on a machine without CUDA (the CPU build or nothing)."""
    reqs = list(requirements)
    if has_cuda() if cuda is None else cuda:
        return [Attempt(reqs, [], "")]
    torch_req = next(r for r in reqs if r.startswith("torch") and re.match(r"^torch(?![A-Za-z0-9._-])", r))
    index = cpu_index()
    extra = ["--extra-index-url", index, "--retries", "1", "--timeout", "20"]
    exact = _EXACT.match(torch_req)
    heavy = ("installing the build your package sources have (from PyPI on Linux: the CUDA build, about 0.5 GB and "
                "several GB of CUDA libraries; it runs on the CPU)")
    if not exact:  # a range: pip prefers X+cpu over X when the index answers, and takes PyPI's build when it does not
        return [Attempt(reqs, extra, f"no CUDA here: asking PyTorch's CPU index ({index}) for the CPU build of {torch_req}; "
                                     f"if it cannot be reached, {heavy}")]
    cpu = [f"torch=={exact.group(1)}+cpu" if r == torch_req else r for r in reqs]
    out = [Attempt(cpu, [], f"no CUDA here: asking your package sources for torch {exact.group(1)}+cpu (the CPU build)"),
           Attempt(cpu, extra, f"asking PyTorch's CPU index ({index}) for torch {exact.group(1)}+cpu")]
    if fallback:
        out.append(Attempt(reqs, [], f"torch {exact.group(1)}+cpu is on neither your package sources nor {index}: {heavy}"))
    return out
