"""Where the evaluation reads each model's weights, one block at a time: the saved quantized files, or, where they
have left the disk (``--low-disk`` with a push uploads and deletes each shard), the base's weights quantized again as
they are read, with the library's own quantize call (the streaming engine's: the same bytes it saved, which the
verification checked digest for digest); the base in the dtypes its loader gives.

A ``Weights`` is a shard source plus the ``cast(name, tensor)`` applied to every tensor read from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import adapters, loadpath
from publisher.fp8cpu import cpu_quantization_context
from publisher.recipes import build_config
from publisher.streaming.shards import LocalShards, ShardSource, TensorReader, build_index

if TYPE_CHECKING:  # types only
    from publisher.recipes import Recipe


@dataclass
class Weights:
    source: ShardSource
    cast: Callable[[str, Any], Any]
    how: str  # for the card: "the saved files", "the base, quantized again as it is read", "the base"
    key: tuple[Any, ...] = ()  # the base's: what decides the tensors read (equal keys, equal tensors; reference.py)


def _same(name: str, t: Any) -> Any:
    return t


def saved(source: ShardSource) -> Weights:
    return Weights(source, _same, "the saved files")


class Requantize:
    """``cast`` for base tensors: the library's loader dtype for each, and the recipe's quantization for the weights its
    quantizer converts (publisher/adapters: the streaming engine's own library adapter)."""

    def __init__(self, library: str, class_name: str, config_dir: Path, recipe: Recipe, exclude: list[str],
                 component: str) -> None:

        self.recipe = recipe
        # the config this component got (a per-component --quant gives each its own; "" is a transformers model)
        self.comp = adapters.of(library)(config_dir, build_config(recipe, component), list(exclude), class_name)

    def base_key(self) -> tuple[str, ...]:
        """What decides ``base``'s tensors besides the source: the dtype it casts to, and the quantized keys whose dtype
        would otherwise differ (for the others, quantized or not, the cast is the same)."""
        comp = self.comp
        return (str(comp.cast_dtype), *sorted(k for k in comp.quantize_keys
                                              if comp.pass_dtype(k, comp.cast_dtype) != comp.cast_dtype))

    def base(self, name: str, t: Any) -> Any:
        import torch

        if type(t) is not torch.Tensor or not t.is_floating_point():
            return t
        if name in self.comp.quantize_keys:
            return t.to(self.comp.cast_dtype)
        return t.to(self.comp.pass_dtype(name, t.dtype))

    def quantized(self, name: str, t: Any) -> Any:
        value = self.base(name, t)
        if name not in self.comp.quantize_keys:
            return value
        with self._context():
            weight = self.comp.quantize_param(name, value, "cpu")
        self.comp.detach_weight(name)  # the meta model lets go of it: the block loader holds it until the block ran
        return weight

    @contextmanager
    def _context(self) -> Iterator[None]:
        if getattr(self.recipe, "cpu_producible", False):
            with cpu_quantization_context(self.recipe):
                yield
        else:
            yield


def component_weights(library: str, class_name: str, base: ShardSource, config_dir: Path, recipe: Recipe,
                      exclude: list[str], quantized_files: ShardSource | None, component: str) -> tuple[Weights, Weights]:
    """(base, quantized) weights of the quantized ``component`` ("" for a transformers model)."""
    requant = Requantize(library, class_name, config_dir, recipe, exclude, component)
    base_w = Weights(base, requant.base, "the base", (library, class_name, component, base.where, *requant.base_key()))
    if quantized_files is not None:
        return base_w, saved(quantized_files)
    return base_w, Weights(base, requant.quantized, "the base, quantized again as it was read (the saved shards "
                                                      "had been uploaded and deleted)")


def local_shards(folder: Path) -> ShardSource | None:
    """The saved safetensors of a component folder, or None when they are not on disk."""

    files = sorted(p.name for p in folder.glob("*.safetensors"))
    index = next(iter(folder.glob("*.safetensors.index.json")), None)
    if not files:
        return None
    if index is not None:
        import json

        named = set(json.loads(index.read_text())["weight_map"].values())
        if not named <= set(files):
            return None  # some shards left the disk (uploaded and deleted)
    return LocalShards(folder, files)


def load_whole(model: Any, weights: Weights, library: str) -> Any:
    """Every tensor of ``weights`` into the meta-device ``model`` (the manual load path: ``load_into``), for a component
    small enough to stay in memory while the evaluation runs."""

    index = build_index(weights.source)
    with TensorReader(weights.source, index) as reader:
        state = {name: weights.cast(name, reader.read(name)) for name in index.parts}
    if adapters.of(library).renames_checkpoint_keys:
        state = loadpath.convert_checkpoint_keys(model, state)
    return loadpath.load_into(model, state).eval()
