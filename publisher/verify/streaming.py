"""Streaming verification: the checks of a full reload, with one tensor or one block in memory at a time.

Used when a component's full reload would not fit in memory (``--verify-mode streaming``, or
``auto`` on a small machine), and for the post-push check of such a component. Two checks:

1. Tensor by tensor: every saved tensor is rebuilt from its safetensors parts with torchao's own
   ``unflatten_tensor_state_dict`` (what the loaders do), must be of the recipe's tensor class where a
   layer was quantized, and its digest must equal the digest the quantization recorded for the same
   tensor while it was in memory. Nothing missing, nothing extra.
2. Per-block forward: the model is built on the meta device and run on the seeded verification
   inputs with each block's weights loaded from the saved files just before the block runs
   (``load_state_dict(strict=True, assign=True)``, the manual load path, block by block) and dropped
   right after. Blocks are the largest modules whose bf16 weights fit in ``block_budget``. The output
   must be finite, and is compared with the same block-by-block forward of the bf16 base (quality)
   and, when a full reload produced one, with the expected output (bit for bit).

Peak memory: one block (bf16 for the base forward) plus activations, whatever the model size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from publisher import loadpath
from publisher.handoffs.report import Expected, PathResult
from publisher.loadpath import forward, tensor_digest
from publisher.loadpath import meta_model as build
from publisher.runtime import progress
from publisher.runtime.heap import trim_memory
from publisher.streaming.shards import CheckpointIndex, ShardSource, TensorReader, build_index
from publisher.verify import rowwise

log = logging.getLogger(__name__)

BLOCK_BUDGET = 256 * 1024 * 1024  # bytes of bf16 weights per block loaded at once


@dataclass
class TensorCheck:
    ok: bool
    checked: int
    detail: str = ""
    quantized_layers: int = 0  # planned quantized layers that came back as the recipe's class
    of_class: int = 0  # tensors of the recipe's class among those checked


def check_tensors(source: ShardSource, expected: dict[str, str], quantized: list[str], tensor_class: str | Collection[str],
                  index: CheckpointIndex | None = None, only: set[str] | None = None,
                  layer_classes: Mapping[str, str] | None = None) -> TensorCheck:
    """Every saved tensor against the digest of the in-memory tensor it came from (one at a time).

    ``tensor_class``: the recipe's class, or the classes its configs make; ``layer_classes``: layer -> the class its config
    implies (per-layer configs), which takes precedence. ``only``: check just these names (the shard uploader checks a
    shard's tensors as they complete)."""

    index = index or build_index(source)
    names = [n for n in index.names if only is None or n in only]
    wanted_class = {f"{m}.weight" for m in quantized}
    allowed = {tensor_class} if isinstance(tensor_class, str) else set(tensor_class)
    allowed |= set((layer_classes or {}).values())
    allowed.discard("")
    seen: set[str] = set()
    classes = of_class = 0
    known = set(expected.values())
    with TensorReader(source, index) as reader, _bar(sum(index.nbytes(n) for n in names), f"verify {source.where}",
                                                     "B") as bar:
        for name in names:
            bar.update(index.nbytes(name))
            t = reader.read(name)
            of_class += type(t).__name__ in allowed
            if name in wanted_class:
                want = (layer_classes or {}).get(name[:-7])
                if (type(t).__name__ != want) if want else (type(t).__name__ not in allowed):
                    expected_text = want or " or ".join(sorted(allowed))
                    return TensorCheck(False, len(seen), f"layer {name[:-7]} reloaded as {type(t).__name__}, expected {expected_text}")
                classes += 1
            digest = tensor_digest(t)
            del t
            seen.add(name)
            if name not in expected:
                if digest in known:
                    continue  # a tied weight saved under its other name
                return TensorCheck(False, len(seen), f"unexpected tensor {name} in {source.where}")
            if digest != expected[name]:
                return TensorCheck(False, len(seen), f"tensor {name} differs from the in-memory quantized tensor")
    trim_memory()
    missing = sorted(set(expected) - seen)
    if missing:
        return TensorCheck(False, len(seen), f"tensor {missing[0]} missing from {source.where}")
    unquantized = sorted(wanted_class - seen)
    if unquantized:
        return TensorCheck(False, len(seen), f"quantized layer {unquantized[0][:-7]} has no saved weight")
    return TensorCheck(True, len(seen), quantized_layers=classes, of_class=of_class)


# ------------------------------------------------------------------ block-by-block forward

def meta_model(library: str, class_name: str, config: dict[str, Any]) -> Any:
    """The component on the meta device, tied weights tied (the manual load path's own model)."""

    model = build(library, class_name, config)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def _bytes(module: Any, recurse: bool) -> int:
    return sum(p.numel() * 2 for p in module.parameters(recurse=recurse))


def blocks(model: Any, budget: int) -> list[tuple[str, Any, bool]]:
    """(prefix, module, whole): modules loaded together. ``whole``: the module with everything under
    it; otherwise only its own parameters and buffers (its children are blocks of their own)."""
    out: list[tuple[str, Any, bool]] = []

    def visit(prefix: str, module: Any) -> None:
        children = list(module.named_children())
        if _bytes(module, True) <= budget or not children:
            if _bytes(module, True) or any(True for _ in module.buffers()):
                out.append((prefix, module, True))
            return
        if _bytes(module, False) or module._buffers:
            out.append((prefix, module, False))
        for name, child in children:
            visit(f"{prefix}{name}.", child)

    visit("", model)
    return out


def own_state(module: Any, whole: bool) -> list[tuple[Any, str, str, bool]]:
    """(owner module, attribute, state-dict suffix, is_parameter) for what a block loads."""
    items: list[tuple[Any, str, str, bool]] = []
    mods = module.named_modules(remove_duplicate=False) if whole else [("", module)]
    for sub, mod in mods:
        pre = f"{sub}." if sub else ""
        for n, p in mod._parameters.items():
            if p is not None:
                items.append((mod, n, pre + n, True))
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                items.append((mod, n, pre + n, False))
    return items


def checkpoint_key_targets(model: Any, keys: list[str]) -> dict[str, str]:
    """Checkpoint key -> the model key it loads into, for the keys transformers renames or merges (empty for
    everything else): what ``loadpath.convert_checkpoint_keys`` does, without reading a tensor (block by block)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:
        return {}
    if not isinstance(model, PreTrainedModel):
        return {}
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    expected = model.state_dict()
    out = {}
    for key in keys:
        target, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if target != key:
            out[key] = target
    return out


class BlockLoader:
    """Forward pre/post hooks that load a block's saved weights just in time and drop them after."""

    def __init__(self, model: Any, reader: TensorReader, budget: int, cast: Callable[[str, Any], Any] | None = None) -> None:
        self.reader = reader
        self.cast = cast or (lambda name, t: t)
        self.names = set(reader.index.parts)
        self.model = model
        self.converted: dict[str, list[str]] = {}  # model key -> checkpoint keys transformers merges into it (MoE)
        for key, target in checkpoint_key_targets(model, list(self.names)).items():
            self.converted.setdefault(target, []).append(key)
        self.aliases = self._aliases(model)
        self.budget = budget
        self.blocks = blocks(model, budget)
        self.row_by_row: list[str] = []  # the blocks read row by row (rowwise.py)
        self._rows: list[Any] = []  # heads whose forward was replaced
        self.loaded = 0
        self.peak_block_bytes = 0
        self.bar: Any = None
        self._handles: list[Any] = []
        self._saved: dict[int, list[tuple[Any, str, Any, bool]]] = {}

    @staticmethod
    def _aliases(model: Any) -> dict[str, list[str]]:
        """Tied weights: every name of a shared parameter (only one of them is saved)."""
        by_id: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        return {n: names for names in by_id.values() for n in names if len(names) > 1}

    def _source_name(self, key: str) -> str:
        if key in self.names:
            return key
        for other in self.aliases.get(key, []):
            if other in self.names:
                return other
        raise KeyError(f"{key} is not in the saved files ({self.reader.source.where})")

    def _read(self, key: str) -> Any:
        if key not in self.converted:
            return self.reader.read(self._source_name(key))
        parts = {k: self.reader.read(k) for k in self.converted[key]}
        return loadpath.convert_checkpoint_keys(self.model, parts)[key]  # the manual path's own conversion

    def attach(self) -> None:
        for prefix, module, whole in self.blocks:
            if whole and self._row_by_row(prefix, module):
                continue
            self._handles.append(module.register_forward_pre_hook(self._loader(prefix, module, whole)))
            self._handles.append(module.register_forward_hook(self._dropper(module)))

    def _row_by_row(self, prefix: str, module: Any) -> bool:
        """An embedding or head over the budget, stored plain and kept plain by ``cast``: read row by row
        (``rowwise.py``) instead of whole. False (loaded whole, as any block) otherwise."""
        import torch


        key = prefix + "weight"
        ends = [getattr(self.model, f"get_{which}_embeddings", lambda: None)() for which in ("input", "output")]
        if all(module is not end for end in ends) or not rowwise.candidate(module, self.budget) or key in self.converted:
            return False
        try:
            name = self._source_name(key)
        except KeyError:
            return False
        if not self.reader.plain_rows(name) or type(self.cast(name, self.reader.read_rows(name, 0, 1))) is not torch.Tensor:
            return False
        if isinstance(module, torch.nn.Embedding):
            rows = rowwise.RowEmbedding(module, self.reader, name, self.cast)
            self._handles.append(module.register_forward_pre_hook(rows.before, with_kwargs=True))
            self._handles.append(module.register_forward_hook(rows.after))
        else:
            bias = prefix + "bias" if getattr(module, "bias", None) is not None else None
            head = rowwise.RowLinear(module, self.reader, name, bias and self._source_name(bias), self.cast)
            module.forward = head  # the module's hooks (none of ours) still run around it
            module.row_linear = head  # lm.NllHead asks for it: perplexity without whole logits
            self._rows.append(module)
        self.row_by_row.append(prefix.rstrip(".") or "root")
        return True

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._rows:
            for attr in ("forward", "row_linear"):
                module.__dict__.pop(attr, None)
        self._rows.clear()

    def _loader(self, prefix: str, module: Any, whole: bool) -> Any:
        def hook(mod: Any, args: Any) -> None:
            items = own_state(module, whole)
            state = {suffix: self.cast(prefix + suffix, self._read(prefix + suffix)) for _, _, suffix, _ in items}
            size = sum(_nbytes(t) for t in state.values())
            self.peak_block_bytes = max(self.peak_block_bytes, size)
            self._saved[id(module)] = [(owner, attr, (owner._parameters if is_p else owner._buffers)[attr], is_p)
                                       for owner, attr, _, is_p in items]
            if whole:
                result = module.load_state_dict(state, strict=True, assign=True)
            else:
                result = module.load_state_dict(state, strict=False, assign=True)
                own = {s for _, _, s, _ in items}
                bad = [k for k in result.missing_keys if k in own]
                if bad or result.unexpected_keys:
                    raise RuntimeError(f"block {prefix or 'root'}: missing {bad[:3]}, unexpected {result.unexpected_keys[:3]}")
            self.loaded += 1
            if self.bar is not None:
                self.bar.update(1)

        return hook

    def _dropper(self, module: Any) -> Any:
        def hook(mod: Any, args: Any, output: Any) -> None:
            for owner, attr, original, is_p in self._saved.pop(id(module), []):
                (owner._parameters if is_p else owner._buffers)[attr] = original  # back to meta: memory freed
            trim_memory()

        return hook


def _nbytes(t: Any) -> int:
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ not in ("Tensor", "Parameter"):
        inner, _ = t.__tensor_flatten__()
        return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in inner)
    return int(t.numel() * t.element_size())


@dataclass
class BlockForward:
    output: Any
    blocks: int  # blocks loaded during the pass
    peak_block_bytes: int


def block_forward(source: ShardSource, library: str, class_name: str, config: dict[str, Any], inputs: dict[str, Any],
                  budget: int = BLOCK_BUDGET, index: CheckpointIndex | None = None,
                  cast: Callable[[str, Any], Any] | None = None) -> BlockForward:
    """One forward pass with at most one block's weights in memory. ``cast(name, tensor)``: applied to each tensor
    as it is read (the quality figures run a float32 or float16 base in the dtypes the quantized side was loaded in)."""

    model = meta_model(library, class_name, config)
    index = index or build_index(source)
    with TensorReader(source, index) as reader:
        loader = BlockLoader(model, reader, budget, cast)
        with _bar(len(loader.blocks), f"forward block by block {source.where}", "block") as bar:
            loader.bar = bar
            loader.attach()
            try:
                out = forward(model, library, inputs).detach().clone()
            finally:
                loader.detach()
    return BlockForward(out, loader.loaded, loader.peak_block_bytes)


def _bar(total: int, desc: str, unit: str) -> Any:
    """huggingface_hub's tqdm (honours HF_HUB_DISABLE_PROGRESS_BARS), shown where the command shows bars (a terminal,
    not --quiet: runtime/progress.py)."""
    import sys

    from huggingface_hub.utils import tqdm

    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, desc=desc, unit=unit, disable=not progress.shown(), file=sys.stderr, **scale)


def load_config(source: ShardSource) -> dict[str, Any]:
    config = source.json("config.json")
    if config is None:
        raise FileNotFoundError(f"no config.json in {source.where}")
    return config


def streaming_check(exp: Expected, source: ShardSource, tensor_class: str, env: str = "current",
                    forward_optional: bool = False) -> PathResult:
    """A ``PathResult`` for one component: tensor by tensor against the in-memory digests, then the
    block-by-block forward, which runs on the CPU: for a recipe made to run on a GPU (``forward_optional``) a
    CPU without its kernel only costs the forward check, and the detail says so."""
    import torch


    res = PathResult(exp.component, "streaming", env, loadpath.versions(), False)
    if not exp.digests:
        res.detail = "no in-memory digests recorded for this component (resumed from an older cache); use --verify-mode full"
        return res
    try:
        index = build_index(source)
        tc = check_tensors(source, exp.digests, exp.quantized, tensor_class, index, layer_classes=exp.classes)
        res.tensors_checked, res.quantized_layers = tc.checked, tc.quantized_layers
        if not tc.ok:
            res.detail = tc.detail
            return res
        if exp.inputs is not None:
            config = load_config(source)
            try:
                bf = block_forward(source, exp.library, exp.class_name, config, loadpath.load_call(exp.inputs), index=index)
            except (RuntimeError, NotImplementedError) as exc:
                if not forward_optional:
                    raise
                res.ok = True
                res.detail = (f"{tc.checked} tensors equal; forward pass not checked on this CPU "
                              f"({str(exc).splitlines()[0][:160]})")
                return res
            out = bf.output
            if not bool(torch.isfinite(out.float()).all()):
                res.detail = "the block-by-block forward pass gave non-finite values"
                return res
            res.forward_checked = True
            if exp.output is not None:
                res.max_abs_diff = float((out.float() - exp.output.float()).abs().max())
                if out.shape != exp.output.shape or not torch.equal(out, exp.output):
                    res.detail = f"block-by-block output differs from {exp.reference} (max abs diff {res.max_abs_diff:.3g})"
                    return res
            else:
                exp.output = out  # the reference for the quality figure
            res.detail = f"{tc.checked} tensors equal; forward with {bf.blocks} block loads, at most {bf.peak_block_bytes / 2**20:.0f} MiB at once"
        else:
            res.detail = f"{tc.checked} tensors equal; no forward inputs for {exp.class_name}"
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, NotImplementedError) as exc:
        res.detail = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return res
    res.ok = True
    return res
