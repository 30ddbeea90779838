"""The declared ``quantization_config`` against the stored tensors, layer by layer.

What each layer must be comes from the libraries and torchao themselves, not from a table of ours:

1. the config is rebuilt with the library's own ``TorchAoConfig.from_dict`` (torchao's ``config_from_dict``);
2. which parameters the library quantizes is asked of the library's own quantizer on the meta-device model
   (transformers' ``param_needs_quantization``, diffusers' ``check_if_quantized_param``: Linear weights, embeddings
   with ``include_input_output_embeddings``, ``modules_to_not_convert`` and the libraries' default skips);
3. the config of each layer: the ``FqnToConfig`` / ``ModuleFqnToConfig`` entry the library would pick (exact
   parameter fqn, exact module fqn, ``re:`` patterns, ``_default``; ``None`` leaves the layer alone);
4. the tensor that config makes of a layer of that shape and dtype: one throw-away module of the same kind, shape
   and dtype quantized with torchao's ``quantize_`` exactly as the library calls it, then described by torchao's
   ``flatten_tensor_state_dict`` like the stored one (class, dtypes and shapes of qdata / scale / zero point,
   ``block_size``: granularity and group size, activation quantization). Cached per (kind, shape, dtype, config).

A stored torchao tensor that differs fails, naming the layer, what the config says and what the file holds. A layer
the config would quantize but that is stored unquantized is reported (a library's skip rules, or the untied embedding
copy of transformers' ``untie_embedding_weights``, legitimately leave such layers), not failed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publisher import adapters
from publisher.configs.probe import quantized_weight
from publisher.errors import VerificationError
from publisher.handoffs.report import Expected
from publisher.loadpath import meta_model
from publisher.verify import stored as stored_files
from publisher.verify.stored import Stored, StoredSet, parse_flat
from publisher.verify.target_layout import TargetComponent, weight_format

log = logging.getLogger(__name__)

SHOWN = 3  # layer names quoted in one note


@dataclass
class Declared:
    """A component's quantization_config, rebuilt by its library."""

    library: str
    qconfig: Any  # the library's TorchAoConfig
    config: Any  # its quant_type: a torchao AOBaseConfig (an FqnToConfig for per-layer configs)

    @property
    def adapter(self) -> type[adapters.LibraryAdapter]:
        return adapters.of(self.library)

    @property
    def per_layer(self) -> bool:
        from torchao.quantization import FqnToConfig

        return isinstance(self.config, FqnToConfig)

    @property
    def text(self) -> str:
        return type(self.config).__name__


@dataclass
class DeclaredCheck:
    component: str
    config: str  # the declared config's class (FqnToConfig, Int8WeightOnlyConfig...)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)  # module -> the class its config implies (stored quantized)
    checked: int = 0  # quantized layers whose stored format equals the config's
    dtype: str = "bfloat16"  # the dtype the stored torchao tensors record (what the model is loaded in)


def read_declared(comp: TargetComponent, where: str) -> Declared:
    """The component's quantization_config as its library rebuilds it; VerificationError when it cannot."""
    library = __import__(comp.library)
    try:
        qconfig = library.TorchAoConfig.from_dict(dict(comp.quantization))
    except (AssertionError, KeyError, TypeError, ValueError, AttributeError, NotImplementedError) as exc:
        raise VerificationError(
            f"{where}: its quantization_config cannot be rebuilt by {comp.library}'s TorchAoConfig with this torchao "
            f"({type(exc).__name__}: {_first(exc)}); it was made for another torchao release, or edited") from None
    return Declared(comp.library, qconfig, qconfig.quant_type)


def _first(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def layer_config(declared: Declared, param: str) -> tuple[Any, str]:
    """(the torchao config the library applies to ``param``, where it comes from); None: left unquantized. The rule
    is the library adapter's, which the quantize stage and the streaming engine follow too."""
    if not declared.per_layer:
        return declared.config, "the quant_type"
    return declared.adapter.resolve(declared.config.fqn_to_config, param)


_PROBES: dict[tuple[Any, ...], Stored | None | str] = {}


def probe(kind: str, shape: tuple[int, ...], dtype: str, config: Any, library: str, per_layer: bool) -> Stored | None:
    """The tensor ``config`` makes of a ``kind`` ("linear" / "embedding") weight of ``shape`` and ``dtype``, quantized
    as the library calls ``quantize_``; None when torchao leaves such a layer unquantized. RuntimeError when it
    cannot be made here (a GPU-only format)."""
    from torchao.core.config import config_to_dict

    key = (kind, shape, dtype, json.dumps(config_to_dict(config), sort_keys=True), library, per_layer)
    if key not in _PROBES:
        try:
            _PROBES[key] = _probe(kind, shape, dtype, config, library, per_layer)
        except (AssertionError, RuntimeError, ValueError, ImportError, NotImplementedError, TypeError) as exc:
            _PROBES[key] = f"{type(exc).__name__}: {_first(exc)}"
    found = _PROBES[key]
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def _probe(kind: str, shape: tuple[int, ...], dtype: str, config: Any, library: str, per_layer: bool) -> Stored | None:
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    # transformers applies an FqnToConfig entry to the lone module with filter_fn "always"; every other call (and
    # diffusers) uses quantize_'s default filter (Linear layers only)
    every_module = adapters.of(library).entries_apply_to_whole_module and per_layer
    weight = quantized_weight(config, shape, dtype, kind=kind, every_module=every_module)
    if type(weight).__name__ in ("Parameter", "Tensor"):
        return None
    flat, metadata = flatten_tensor_state_dict({"p.weight": weight})
    found = parse_flat(flat, metadata).get("p.weight")
    return found if found is not None and found.quantized else None


# ------------------------------------------------------------------------------------------------ comparing


def granularity(s: Stored, shape: tuple[int, ...]) -> str:
    block = s.data.get("block_size")
    if not isinstance(block, list) or len(block) != len(shape):
        return ""
    if list(block) == list(shape):
        return "per tensor"
    if len(shape) == 2 and block[0] == 1 and block[1] == shape[1]:
        return "per row"
    if len(shape) == 2 and block[0] == 1:
        return f"group size {block[1]}"
    return f"block {block}"


def describe(s: Stored, shape: tuple[int, ...]) -> str:
    """``Int8Tensor (qdata int8, scale float32 [128, 1], per row)``."""
    if not s.quantized:
        return f"an unquantized {s.dtype} weight"
    parts = ", ".join(f"{p} {d}{list(sh) if p != 'qdata' else ''}" for p, (d, sh) in sorted(s.parts.items()))
    extra = [granularity(s, shape)]
    target = s.data.get("target_dtype")
    if isinstance(target, dict) and target.get("_data"):
        extra.append(f"{target['_data']} values")
    act = s.data.get("act_quant_kwargs") or s.data.get("activation_quantization")
    if act:
        extra.append("activations quantized" + (f" ({act})" if isinstance(act, str) else ""))
    return f"{s.kind} ({'; '.join(filter(None, [parts, *extra]))})"


def differences(expected: Stored, found: Stored) -> list[str]:
    """What differs between two described tensors, most telling first (empty: the same format)."""
    if expected.kind != found.kind:
        return ["class"]
    out = []
    if set(expected.parts) != set(found.parts):
        out.append("parts")
    for part in sorted(set(expected.parts) & set(found.parts)):
        (d1, s1), (d2, s2) = expected.parts[part], found.parts[part]
        if d1 != d2:
            out.append(f"{part} dtype")
        if s1 != s2:
            out.append(f"{part} shape")
    for attr in sorted(set(expected.data) | set(found.data)):
        if attr != "dtype" and _canon(expected.data.get(attr)) != _canon(found.data.get(attr)):
            out.append(attr)
    return out


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def check(comp: TargetComponent, declared: Declared, stored: StoredSet, model: Any) -> DeclaredCheck:
    """Every stored tensor of ``comp`` against what ``declared`` makes of its layer (module docstring)."""
    import torch

    result = DeclaredCheck(comp.name, declared.text)
    quantized = [s for s in stored.tensors.values() if s.quantized]
    if quantized:
        dtypes = [s.dtype for s in quantized]
        result.dtype = max(set(dtypes), key=dtypes.count)
    elif not stored.not_checked:
        result.problems.append(f"{comp.label}: its quantization_config declares {declared.text}, but no stored tensor is a "
                               "torchao tensor (the weights were saved unquantized, or converted)")
        return result
    modules = dict(model.named_modules())
    try:
        # the library's own quantizer, prepared on the meta-device model as its loader would prepare it
        q = declared.adapter.loader_quantizer(declared.qconfig, model)
    except (ValueError, TypeError, AttributeError, ImportError, KeyError) as exc:
        result.problems.append(f"{comp.label}: {comp.library}'s own quantizer cannot be prepared for its declared "
                               f"{declared.text} ({type(exc).__name__}: {_first(exc)}), so no layer could be checked")
        return result
    stored_plain: list[str] = []
    for name, s in sorted(stored.tensors.items()):
        module_name, param = name.rsplit(".", 1) if "." in name else ("", name)
        module = modules.get(module_name)
        kind = ("linear" if isinstance(module, torch.nn.Linear) else
                "embedding" if isinstance(module, torch.nn.Embedding) else None)
        if (kind is None or param != "weight") and not s.quantized:
            continue
        if module is None or kind is None or param != "weight":
            result.notes.append(f"{name} is a {s.kind} on a {type(module).__name__ if module else 'missing'} module; "
                                "its format was not derived from the config")
            continue
        config, why = layer_config(declared, name) if declared.adapter.quantizes(q, model, name) else (None, "")
        shape = tuple(module.weight.shape)
        if config is None:
            if s.quantized:
                reason = why or f"{comp.library} does not quantize it (modules_to_not_convert, or its default skips)"
                result.problems.append(f"layer {module_name}: the config leaves it unquantized ({reason}); the file holds "
                                       f"{describe(s, shape)}")
            continue
        try:
            expected = probe(kind, shape, s.dtype if s.quantized else result.dtype, config, declared.library, declared.per_layer)
        except RuntimeError as exc:
            result.notes.append(f"layer {module_name}: what {type(config).__name__} makes of it cannot be derived on this "
                                f"machine ({exc}); its format was not checked")
            continue
        if expected is None:
            if s.quantized:
                result.problems.append(f"layer {module_name}: torchao leaves a layer of this shape unquantized under the "
                                       f"config's {type(config).__name__} ({why}), but the file holds {describe(s, shape)}")
            continue
        if not s.quantized:
            stored_plain.append(module_name)
            continue
        result.classes[module_name] = expected.kind  # what every load must give, whatever the file holds
        diff = differences(expected, s)
        if diff:
            which = "" if diff == ["class"] else f" (differs in {', '.join(diff)})"
            result.problems.append(f"layer {module_name}: the config says {type(config).__name__} ({why}): "
                                   f"{describe(expected, shape)}; the file holds {describe(s, shape)}{which}")
            continue
        result.checked += 1
    if stored_plain:
        result.notes.append(f"{len(stored_plain)} layer(s) the config would quantize are stored unquantized "
                            f"({', '.join(stored_plain[:SHOWN])}{', ...' if len(stored_plain) > SHOWN else ''})")
    return result


def check_saved(comp: TargetComponent, found: stored_files.StoredSet, where: str) -> tuple[Declared | None, DeclaredCheck]:
    """``comp``'s stored tensors (``found``: stored.describe_files, read once by the caller) against its declared
    config (``check``): (the rebuilt config, or None when it cannot be rebuilt, and the layer check)."""

    try:
        decl = read_declared(comp, where)
    except VerificationError as exc:
        return None, DeclaredCheck(comp.name, "unreadable", problems=[str(exc)])
    result = check(comp, decl, found, meta_model(comp.library, comp.class_name, comp.config))
    result.notes = found.not_checked + result.notes
    return decl, result


def apply_to_expected(expected: list[Expected], folders: dict[str, Path], made: dict[str, dict[str, str]]) -> list[str]:
    """A publish's expected records get the class each layer's config implies, derived the way ``verify TARGET``
    derives it: the saved files against their declared config. ``folders``: component -> its saved folder (absent:
    its shards were uploaded and deleted, so the classes the streaming engine planned and checked, ``made``, stand).
    Returns the problems (a layer stored otherwise than its config makes it)."""
    problems: list[str] = []
    for exp in expected:
        folder = folders.get(exp.component)
        if not exp.quantized:  # published unquantized on request (--allow-unquantized): no layer to derive
            continue
        if folder is None:
            exp.classes = dict(made.get(exp.component, {}))
            continue
        config = json.loads((folder / "config.json").read_text())
        comp = TargetComponent(exp.component, exp.library, exp.class_name, config)
        found = stored_files.describe_files(folder, weight_format(folder))
        _, result = check_saved(comp, found, f"{comp.label}/config.json")
        problems += result.problems
        exp.classes = dict(result.classes)
        missing = [n for n in exp.quantized if n not in exp.classes and n in made.get(exp.component, {})]
        exp.classes.update({n: made[exp.component][n] for n in missing})  # formats this machine cannot derive
    return problems
