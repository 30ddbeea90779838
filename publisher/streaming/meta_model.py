"""The library side of the streaming engine: a meta-device model built the way ``from_pretrained`` builds it.

Bit-identity with the documented library path comes from *reusing* the libraries' own code, not
from re-implementing it: the quantizer object ``from_pretrained`` would create decides which
parameters get quantized (``check_if_quantized_param`` / ``param_needs_quantization``: exclusions,
keep-in-fp32 modules, transformers' default skips), quantizes them (``create_quantized_param`` /
``TorchAoQuantize.convert``, i.e. torchao's ``quantize_`` on the model's own ``nn.Linear``), flattens
the state dict (``get_state_dict_and_metadata``) and writes config.json. Only the loops around
those calls (read a tensor, cast it, write it) are ours, and they follow the loaders' dtype rules,
quoted next to each rule below.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class MetaModel:
    """A meta-device model plus the library hooks the engine calls for one component."""

    library: str
    class_name: str
    model: Any  # on the meta device; weights are attached one at a time and detached again
    names: list[str]  # state-dict keys, in state_dict() order (the order save_pretrained shards in)
    meta: dict[str, Any]  # state-dict key -> meta tensor
    linear_weights: set[str]  # keys that are the weight of an nn.Linear
    quantize_keys: set[str]  # keys the library quantizer will quantize
    dropped_on_save: set[str]  # keys in the state dict but not in the files (tied weights)
    weights_name: str  # e.g. "diffusion_pytorch_model.safetensors"
    index_name: str
    max_shard_size: int | str  # save_pretrained's default
    header_metadata: Callable[[dict[str, str]], dict[str, str]]
    index_metadata: Callable[[int, dict[str, str]], dict[str, Any]]
    write_configs: Callable[[Path], list[Path]]
    quantize_param: Callable[[str, torch.Tensor, Any], Any]  # (key, bf16 value, device) -> new weight
    pass_dtype: Callable[[str, torch.dtype], torch.dtype]  # (key, checkpoint dtype) -> saved dtype
    cast_dtype: torch.dtype  # what a weight is cast to before quantizing
    quantizer: Any = None  # the library's quantizer object, as from_pretrained creates it
    save_order: Callable[[list[str]], list[str]] = list  # order of the flattened dict save_pretrained shards
    default_skips: set[str] = field(default_factory=set)  # Linear modules the library keeps by default
    meta_params: dict[str, Any] = field(default_factory=dict)  # key -> the meta Parameter to restore
    config_key: Callable[[str], str] = lambda key: ""  # key -> identity of the config it gets (per-layer tables)

    def module_of(self, key: str) -> Any:
        return self.model.get_submodule(key.rpartition(".")[0])

    def detach_weight(self, key: str) -> None:
        """Put the meta tensor back so the real one is freed as soon as the engine drops it."""
        module_path, _, attr = key.rpartition(".")
        self.model.get_submodule(module_path)._parameters[attr] = self.meta_params[key]


def _linear_weights(model: Any) -> set[str]:
    import torch

    return {f"{name}.weight" if name else "weight" for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear)}


def _is_subclass(cls: Any, base: Any) -> bool:
    """A named class of the library (a bool, so ``cls`` keeps its dynamic type for what follows)."""
    return inspect.isclass(cls) and issubclass(cls, base)


def _save_default(cls: Any) -> int | str:
    return inspect.signature(cls.save_pretrained).parameters["max_shard_size"].default


def diffusers_component(src: Path, ao_config: Any, exclude: list[str], class_name: str | None) -> MetaModel:
    """Mirror ``ModelMixin.from_pretrained`` (diffusers 0.42) up to the point where weights are read."""
    import diffusers
    import torch
    from accelerate import init_empty_weights
    from diffusers.models.modeling_utils import no_init_weights
    from diffusers.quantizers import DiffusersAutoQuantizer
    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME

    if class_name is None:
        from publisher.jsonfile import read_object

        class_name = read_object(src / "config.json").get("_class_name")
    name = class_name if isinstance(class_name, str) else None
    cls: Any = getattr(diffusers, name or "", None)
    if not _is_subclass(cls, diffusers.ModelMixin):
        raise ValueError(f"config.json names no diffusers model class ({name!r})")
    config, unused_kwargs = cls.load_config(src, return_unused_kwargs=True)
    config = copy.deepcopy(config)  # from_pretrained: "no in-place modification of the original config"
    qconf = diffusers.TorchAoConfig(ao_config, modules_to_not_convert=list(exclude) or None)
    config["quantization_config"] = qconf
    quantizer = DiffusersAutoQuantizer.from_config(qconf, pre_quantized=False)
    quantizer.validate_environment(torch_dtype=torch.bfloat16, device_map=None)
    dtype = quantizer.update_torch_dtype(torch.bfloat16)
    # from_pretrained: the class's keep-in-fp32 list applies when the quantizer opts in (torchao does)
    keep_fp32: list[str] = []
    if cls._keep_in_fp32_modules is not None and getattr(quantizer, "use_keep_in_fp32_modules", False):
        keep = cls._keep_in_fp32_modules
        keep_fp32 = list(keep) if isinstance(keep, (list, tuple, set)) else [keep]
    dtype_orig = cls._set_default_torch_dtype(dtype)
    try:
        with no_init_weights(), init_empty_weights():
            model = cls.from_config(config, **unused_kwargs)
    finally:
        torch.set_default_dtype(dtype_orig)
    quantizer.preprocess_model(model=model, device_map=None, keep_in_fp32_modules=keep_fp32)
    # from_pretrained records the path exactly as it was given; callers pass the same Path.
    model.register_to_config(_name_or_path=src, _pre_quantization_dtype=dtype)
    model.eval()

    sd = model.state_dict()
    names = list(sd)
    if len(dict(model.named_parameters(remove_duplicate=False))) != len(dict(model.named_parameters())):
        raise ValueError(f"{cls.__name__} shares parameters between modules; safetensors cannot save it as is")
    quantize_keys = {k for k in names if quantizer.check_if_quantized_param(model, sd[k], k, {}, param_device="cpu")}

    def pass_dtype(key: str, src_dtype: torch.dtype) -> torch.dtype:
        # load_model_dict_into_meta: floats go to `dtype` unless a keep-in-fp32 module owns them
        # (whole dotted component match) or they are float8 with a quantizer; ints/bools stay.
        if not src_dtype.is_floating_point:
            return src_dtype
        if keep_fp32 and any(m in key.split(".") for m in keep_fp32):
            return torch.float32
        if src_dtype == getattr(torch, "float8_e4m3fn", None):
            return src_dtype
        return dtype

    def quantize_param(key: str, value: torch.Tensor, device: Any) -> Any:
        quantizer.create_quantized_param(model, value, key, device, {}, [], dtype=dtype)
        return model.get_parameter(key)

    def header_metadata(qmeta: dict[str, str]) -> dict[str, str]:
        metadata = {"format": "pt", **qmeta}
        return {k: v if isinstance(v, str) else str(v) for k, v in metadata.items()}

    def write_configs(dst: Path) -> list[Path]:
        model.save_config(dst)
        return [dst / "config.json"]

    comp = MetaModel(
        library="diffusers", class_name=cls.__name__, model=model, names=names, meta=sd,
        linear_weights=_linear_weights(model), quantize_keys=quantize_keys, dropped_on_save=set(),
        weights_name=SAFETENSORS_WEIGHTS_NAME, index_name=SAFE_WEIGHTS_INDEX_NAME,
        max_shard_size=_save_default(cls),
        header_metadata=header_metadata,
        index_metadata=lambda total, qmeta: {"total_size": total, **qmeta},
        write_configs=write_configs, quantize_param=quantize_param, pass_dtype=pass_dtype,
        cast_dtype=dtype, quantizer=quantizer,
    )
    comp.meta_params = dict(model.named_parameters(remove_duplicate=False))
    comp.config_key = _config_key("diffusers", ao_config)
    return comp


def _config_key(library: str, ao_config: Any) -> Callable[[str], str]:
    """For an ``FqnToConfig``: the identity of the entry the library applies to a key (configs/layers.py's rule)."""
    table = getattr(ao_config, "fqn_to_config", None)
    if type(ao_config).__name__ != "FqnToConfig" or not isinstance(table, dict):
        return lambda key: ""
    from publisher.configs.layers import resolve
    from publisher.configs.render import canonical

    def key_of(key: str) -> str:
        config = resolve(library, table, key)[0]
        return canonical(config) if config is not None else "none"

    return key_of


def transformers_component(src: Path, ao_config: Any, exclude: list[str], class_name: str | None) -> MetaModel:
    """Mirror ``PreTrainedModel.from_pretrained`` (transformers 5.23) up to the point where weights are read."""
    import torch
    import transformers
    from transformers.core_model_loading import dot_natural_key
    from transformers.integrations.torchao import TorchAoQuantize
    from transformers.modeling_utils import _get_dtype
    from transformers.quantizers.auto import get_hf_quantizer
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
    from transformers.utils.generic import ContextManagers

    if class_name is None:
        archs = transformers.AutoConfig.from_pretrained(src).architectures or []
        class_name = archs[0] if archs else None
    cls: Any = getattr(transformers, class_name or "", None)
    if not _is_subclass(cls, transformers.PreTrainedModel):
        raise ValueError(f"config.json names no transformers model class ({class_name!r} in architectures)")
    config, model_kwargs = cls.config_class.from_pretrained(src, return_unused_kwargs=True)
    qconf = transformers.TorchAoConfig(ao_config, modules_to_not_convert=list(exclude) or None)
    quantizer, config, _ = get_hf_quantizer(config, qconf, None, True, {})
    config, dtype = _get_dtype(torch.bfloat16, None, config, None, None, True, quantizer)
    config.name_or_path = src
    config = copy.deepcopy(config)
    with ContextManagers(cls.get_init_context(dtype, True, False, None)):
        model = cls(config, **model_kwargs)
        quantizer.preprocess_model(model=model, dtype=dtype, device_map=None, checkpoint_files=None, use_kernels=False)
    if model._get_dtype_plan(dtype):
        raise ValueError(f"{cls.__name__} keeps some modules in float32 (dtype plan); the streaming engine does not model that")
    model.tie_weights()  # _finalize_model_loading ties after loading; tying on meta is free
    model.eval()
    quantizer.postprocess_model(model)

    sd = model.state_dict()
    names = list(sd)
    quantize_keys = {k for k in names if quantizer.param_needs_quantization(model, k)}
    dropped = _tied_keys_dropped_on_save(model, names) | (set(model._keys_to_ignore_on_save or ()) & set(names))
    op = TorchAoQuantize(quantizer)

    def quantize_param(key: str, value: torch.Tensor, device: Any) -> Any:
        # core_model_loading materialises the tensor on its device before the quantize op runs
        value = value.to(device)
        op.convert({key: value}, model=model, full_layer_name=key, missing_keys=set())
        return model.get_parameter(key)

    def header_metadata(qmeta: dict[str, str]) -> dict[str, str]:
        metadata = dict(qmeta)
        metadata["format"] = "pt"  # save_pretrained adds it after the torchao entries
        return metadata

    def write_configs(dst: Path) -> list[Path]:
        # save_pretrained: the dtype of the first float parameter and the class name, then the
        # config and (for generative models) the generation config from_pretrained had loaded.
        model.config.dtype = str(dtype).split(".")[1]
        model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
        model.config.save_pretrained(dst)
        written = [dst / "config.json"]
        if model.can_generate():
            _load_generation_config(model, src)
            model.generation_config.save_pretrained(dst)
            written.append(dst / "generation_config.json")
        return written

    comp = MetaModel(
        library="transformers", class_name=cls.__name__, model=model, names=names, meta=sd,
        linear_weights=_linear_weights(model), quantize_keys=quantize_keys, dropped_on_save=dropped,
        weights_name=SAFE_WEIGHTS_NAME, index_name=SAFE_WEIGHTS_INDEX_NAME,
        max_shard_size=_save_default(cls),
        header_metadata=header_metadata,
        index_metadata=lambda total, qmeta: {"total_parameters": model.num_parameters(), "total_size": total},
        write_configs=write_configs, quantize_param=quantize_param,
        # core_model_loading: non-quantized tensors take the meta parameter's dtype (which is
        # `dtype` for floats created under local_torch_dtype); quantized ones are cast to `dtype`.
        pass_dtype=lambda key, src_dtype: sd[key].dtype,
        cast_dtype=dtype, quantizer=quantizer,
        default_skips=set(quantizer.modules_to_not_convert or []) - set(exclude),
        # save_pretrained's revert_weight_conversion rebuilds the dict in dot_natural_key order even
        # when no conversion applies (from_pretrained leaves `_weight_conversions == []`).
        save_order=lambda keys: sorted(keys, key=dot_natural_key),
    )
    comp.meta_params = dict(model.named_parameters(remove_duplicate=False))
    comp.config_key = _config_key("transformers", ao_config)
    return comp


def _tied_keys_dropped_on_save(model: Any, names: list[str]) -> set[str]:
    """The keys ``remove_tied_weights_from_state_dict`` drops: all but the last matching name of a tied group."""
    import re

    from transformers.modeling_utils import _get_tied_weight_keys

    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    patterns = set(_get_tied_weight_keys(model))
    dropped: set[str] = set()
    for group in groups.values():
        if len(group) < 2:
            continue
        matching = [n for n in sorted(group) if any(re.search(p, n) for p in patterns) and n in names]
        if len(matching) < len(group) - 1:
            raise ValueError(f"parameters {group} share storage without a tied-weights declaration")
        dropped.update(matching[: len(group) - 1])
    return dropped


def _load_generation_config(model: Any, src: Path) -> None:
    """What from_pretrained does for generative models: its own ``adjust_generation_fn`` on the folder."""
    if hasattr(model, "adjust_generation_fn"):
        model.adjust_generation_fn(None, False, None, src, None, False, None, False, None, None, "", False)


def check_transformers_keys(comp: MetaModel, checkpoint_keys: list[str]) -> str | None:
    """None when the checkpoint's keys load without renaming (the only case the engine streams)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    conversions = copy.deepcopy(get_model_conversion_mapping(comp.model, None, comp.quantizer))
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    prefix = comp.model.base_model_prefix
    for key in checkpoint_keys:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, comp.meta)
        if renamed != key or pattern is not None:
            return f"checkpoint key {key!r} is renamed to {renamed!r} on load"
    if any(c.was_used() for c in conversions):
        return "a weight conversion of transformers applies to this checkpoint"
    return None
