"""What the streaming engine is asked to do, and the objects it reports to.

A ``StreamJob`` says what to read (a component folder, its shards from ``inputs`` or from the folder itself), the
recipe, and where to write (the output folder, the shard size, the options). Two small protocols are what the
engine calls back while it runs:

- ``TensorObserver`` sees every tensor of the pass while it is in memory (the verification's forward pass and the
  perplexity pass run during quantization, the FP8 error bound), and may choose the reading order;
- ``OutputSink`` is where finished output files go: ``FolderSink`` leaves them in the output folder; the
  ``--low-disk`` push (stages/lowdisk_push.py) checks, uploads and deletes each finished shard, and its disk budget
  makes the engine's writer wait.

``ShardInputs`` is where the input shards come from: ``FolderInputs`` (the component folder's files) unless the job
names another (HTTP range reads of the Hub behind a running hash check: stages/fetch.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from publisher.recipes import Recipe

Library = Literal["diffusers", "transformers"]
Shard = Path | BinaryIO  # an input shard as ``ShardInputs.open`` hands it over: a local path or an open binary file


class ShardInputs(Protocol):
    """Where the engine's input shards come from."""

    def open(self, name: str) -> Shard:
        """Make shard ``name`` available: a path, or an open binary file (e.g. read by HTTP range)."""

    def release(self, shard: Shard) -> None:
        """The engine read all it needs of ``shard`` (an open file is still open then: a hash check may read what
        no tensor used)."""


class FolderInputs:
    """The shards as files of the component folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def open(self, name: str) -> Shard:
        return self.folder / name

    def release(self, shard: Shard) -> None:
        pass


class TensorObserver(Protocol):
    """Sees every tensor of the pass while it is in memory (e.g. a forward pass run during quantization)."""

    def begin(self, readable: list[str]) -> list[str] | None:
        """``readable``: the checkpoint keys the pass reads. Returns the keys in the order it wants them
        (they come first, the rest after them in file order), or None for file order."""

    def wants(self, key: str) -> bool:
        """Whether it needs ``key`` whole (a large pass-through tensor is otherwise copied in chunks)."""

    def tensor(self, key: str, value: torch.Tensor, stored: torch.Tensor) -> None:
        """``value``: the tensor as the model loads it (bf16); ``stored``: what is saved (quantized or the same)."""

    def end(self, ok: bool) -> None:
        """The pass is over (``ok`` False: it failed)."""


class OutputSink(Protocol):
    """Where the output files go once they are written (called on the engine's writer thread, but ``planned``)."""

    def planned(self, files: dict[str, set[str]], digests: Mapping[str, str]) -> None:
        """The layout is known: the output file(s) of every saved tensor (state-dict name -> file names).
        ``digests`` (state-dict name -> the in-memory digest, loadpath.tensor_digest) fills as tensors are written,
        each before the file holding it is reported to ``written``."""

    def reserve(self, path: Path, nbytes: int) -> None:
        """``nbytes`` are about to be written to ``path``; may wait (a disk budget)."""

    def written(self, path: Path) -> None:
        """An output file (config, shard, index) is complete."""


class FolderSink:
    """The output files stay in the output folder."""

    def planned(self, files: dict[str, set[str]], digests: Mapping[str, str]) -> None:
        pass

    def reserve(self, path: Path, nbytes: int) -> None:
        pass

    def written(self, path: Path) -> None:
        pass


@dataclass(frozen=True)
class StreamJob:
    """One component folder to quantize into ``dst_dir`` exactly as from_pretrained + save_pretrained would.

    ``class_name`` defaults to config.json's ``_class_name`` / ``architectures[0]``; ``device`` to cuda for recipes
    that need CUDA when a fitting GPU is present, else cpu: it must be the device the library path would quantize on
    (``device_map="cuda"`` there, plain CPU loading otherwise; FP8-dynamic recipes on a CPU run inside fp8cpu's
    bypass, as the library path does); ``max_shard_size`` defaults to save_pretrained's default. ``component``: the
    pipeline component this folder is (its config when the recipe has one per component, or a per-layer table).
    ``inputs``: where the shards come from (default: ``FolderInputs(src_dir)``). ``name_or_path``: what the saved
    config records as the model's origin (diffusers' ``_name_or_path``), as ``from_pretrained(name_or_path)`` would;
    default ``src_dir``, as ``from_pretrained(src_dir)`` records it.
    """

    src_dir: Path
    dst_dir: Path
    library: Library
    recipe: Recipe
    exclude: Sequence[str] = ()
    class_name: str | None = None
    component: str = ""
    device: str | None = None
    max_shard_size: int | str | None = None
    inputs: ShardInputs | None = None
    progress: bool = True  # a progress bar on stderr
    name_or_path: str | None = None
