"""The library side of the streaming engine: a meta-device model built the way ``from_pretrained`` builds it.

Bit-identity with the documented library path comes from *reusing* the libraries' own code, not
from re-implementing it: the quantizer object ``from_pretrained`` would create decides which
parameters get quantized (``check_if_quantized_param`` / ``param_needs_quantization``: exclusions,
keep-in-fp32 modules, transformers' default skips), quantizes them (``create_quantized_param`` /
``TorchAoQuantize.convert``, i.e. torchao's ``quantize_`` on the model's own ``nn.Linear``), flattens
the state dict (``get_state_dict_and_metadata``) and writes config.json. Only the loops around
those calls (read a tensor, cast it, write it) are ours, and they follow the loaders' dtype rules,
quoted next to each rule below.

One adapter class per library (``DiffusersAdapter``, ``TransformersAdapter``) behind one base class
(``LibraryAdapter``: what the planner and the engine call), built with ``adapter(library, ...)``.
"""

from __future__ import annotations

import copy
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class LibraryAdapter(ABC):
    """A meta-device model built the way one library's ``from_pretrained`` builds it, plus the hooks the engine calls
    for one component (as diffusers' quantizers are one class per method behind one base class).

    Built from the component folder ``src``, the torchao config it is quantized with (``ao_config``: one
    ``AOBaseConfig``, or an ``FqnToConfig`` table), the modules kept by ``exclude`` and the model class (default:
    what config.json names).
    """

    library: ClassVar[str]
    weights_name: str  # the library's own names, e.g. "diffusion_pytorch_model.safetensors"
    index_name: str

    class_name: str
    model: torch.nn.Module  # on the meta device; weights are attached one at a time and detached again
    names: list[str]  # state-dict keys, in state_dict() order (the order save_pretrained shards in)
    meta: dict[str, torch.Tensor]  # state-dict key -> meta tensor
    linear_weights: set[str]  # keys that are the weight of an nn.Linear
    quantize_keys: set[str]  # keys the library quantizer will quantize
    dropped_on_save: set[str]  # keys in the state dict but not in the files (tied weights)
    max_shard_size: int | str  # save_pretrained's default
    cast_dtype: torch.dtype  # what a weight is cast to before quantizing
    quantizer: Any  # the library's quantizer object, as from_pretrained creates it
    default_skips: set[str]  # Linear modules the library keeps by default
    meta_params: dict[str, torch.nn.Parameter]  # key -> the meta Parameter to restore

    def __init__(self, src: Path, ao_config: object, exclude: list[str], class_name: str | None) -> None:
        self.src = src
        self.default_skips = set()
        self._build(src, ao_config, exclude, class_name)
        self.meta_params = dict(self.model.named_parameters(remove_duplicate=False))
        self._key_of = _config_key(self.library, ao_config)

    @abstractmethod
    def _build(self, src: Path, ao_config: object, exclude: list[str], class_name: str | None) -> None:
        """Build the meta model and its quantizer as from_pretrained would, and set the attributes above."""

    @abstractmethod
    def quantize_param(self, key: str, value: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """The library's quantize call on the model's own module: (key, bf16 value, device) -> the new weight."""

    @abstractmethod
    def pass_dtype(self, key: str, src_dtype: torch.dtype) -> torch.dtype:
        """The dtype the library saves a tensor it does not quantize in, given its checkpoint dtype."""

    @abstractmethod
    def header_metadata(self, qmeta: dict[str, str]) -> dict[str, str]:
        """A shard header's ``__metadata__``, from torchao's per-tensor metadata."""

    @abstractmethod
    def index_metadata(self, total: int, qmeta: dict[str, str]) -> dict[str, int | str]:
        """The index file's ``metadata``."""

    @abstractmethod
    def write_configs(self, dst: Path) -> list[Path]:
        """Write the config file(s) save_pretrained writes; returns them in the order written."""

    @abstractmethod
    def record_origin(self, name_or_path: str) -> None:
        """Record ``name_or_path`` as the model's origin, as ``from_pretrained(name_or_path)`` would have."""

    def save_order(self, keys: list[str]) -> list[str]:
        """The order of the flattened state dict save_pretrained shards."""
        return list(keys)

    def check_keys(self, checkpoint_keys: list[str]) -> str | None:
        """None when the checkpoint's keys load as they are (the only case the engine streams), else why not."""
        return None

    def config_key(self, key: str) -> str:
        """The identity of the config ``key`` gets ("" for one config per component; per-layer tables differ)."""
        return self._key_of(key)

    def module_of(self, key: str) -> torch.nn.Module:
        return self.model.get_submodule(key.rpartition(".")[0])

    def detach_weight(self, key: str) -> None:
        """Put the meta tensor back so the real one is freed as soon as the engine drops it."""
        module_path, _, attr = key.rpartition(".")
        self.model.get_submodule(module_path)._parameters[attr] = self.meta_params[key]


def adapter(library: str, src: Path, ao_config: object, exclude: list[str], class_name: str | None) -> LibraryAdapter:
    """The adapter of ``library`` ("diffusers" or "transformers") for the component folder ``src``."""
    cls = DiffusersAdapter if library == "diffusers" else TransformersAdapter
    return cls(src, ao_config, exclude, class_name)


def _linear_weights(model: torch.nn.Module) -> set[str]:
    import torch

    return {f"{name}.weight" if name else "weight" for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear)}


def _is_subclass(cls: object, base: type) -> bool:
    """A named class of the library (a bool, so ``cls`` keeps its dynamic type for what follows)."""
    return inspect.isclass(cls) and issubclass(cls, base)


def _save_default(cls: Any) -> int | str:
    default: int | str = inspect.signature(cls.save_pretrained).parameters["max_shard_size"].default
    return default


class DiffusersAdapter(LibraryAdapter):
    """Mirrors ``ModelMixin.from_pretrained`` (diffusers 0.42) up to the point where weights are read."""

    library = "diffusers"

    def _build(self, src: Path, ao_config: object, exclude: list[str], class_name: str | None) -> None:
        import diffusers
        import torch
        from accelerate import init_empty_weights
        from diffusers.models.modeling_utils import no_init_weights
        from diffusers.quantizers import DiffusersAutoQuantizer
        from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME

        if class_name is None:
            from publisher.io.jsonfile import read_object

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
        self.class_name, self.model, self.names, self.meta = cls.__name__, model, names, sd
        self.quantizer, self.cast_dtype, self.keep_fp32 = quantizer, dtype, keep_fp32
        self.linear_weights = _linear_weights(model)
        self.quantize_keys = {k for k in names if quantizer.check_if_quantized_param(model, sd[k], k, {}, param_device="cpu")}
        self.dropped_on_save = set()
        self.weights_name, self.index_name = SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME
        self.max_shard_size = _save_default(cls)

    def pass_dtype(self, key: str, src_dtype: torch.dtype) -> torch.dtype:
        # load_model_dict_into_meta: floats go to `dtype` unless a keep-in-fp32 module owns them
        # (whole dotted component match) or they are float8 with a quantizer; ints/bools stay.
        import torch

        if not src_dtype.is_floating_point:
            return src_dtype
        if self.keep_fp32 and any(m in key.split(".") for m in self.keep_fp32):
            return torch.float32
        if src_dtype == getattr(torch, "float8_e4m3fn", None):
            return src_dtype
        return self.cast_dtype

    def quantize_param(self, key: str, value: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        self.quantizer.create_quantized_param(self.model, value, key, device, {}, [], dtype=self.cast_dtype)
        return self.model.get_parameter(key)

    def header_metadata(self, qmeta: dict[str, str]) -> dict[str, str]:
        metadata = {"format": "pt", **qmeta}
        return {k: v if isinstance(v, str) else str(v) for k, v in metadata.items()}

    def index_metadata(self, total: int, qmeta: dict[str, str]) -> dict[str, int | str]:
        return {"total_size": total, **qmeta}

    def write_configs(self, dst: Path) -> list[Path]:
        self.model.save_config(dst)
        return [dst / "config.json"]

    def record_origin(self, name_or_path: str) -> None:
        self.model.register_to_config(_name_or_path=name_or_path)  # saved in config.json


def _config_key(library: str, ao_config: object) -> Callable[[str], str]:
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


class TransformersAdapter(LibraryAdapter):
    """Mirrors ``PreTrainedModel.from_pretrained`` (transformers 5.23) up to the point where weights are read."""

    library = "transformers"

    def _build(self, src: Path, ao_config: object, exclude: list[str], class_name: str | None) -> None:
        import torch
        import transformers
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
        self.class_name, self.model, self.names, self.meta = cls.__name__, model, names, sd
        self.quantizer, self.cast_dtype = quantizer, dtype
        self.linear_weights = _linear_weights(model)
        self.quantize_keys = {k for k in names if quantizer.param_needs_quantization(model, k)}
        self.dropped_on_save = _tied_keys_dropped_on_save(model, names) | (set(model._keys_to_ignore_on_save or ()) & set(names))
        self.weights_name, self.index_name = SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME
        self.max_shard_size = _save_default(cls)
        self.default_skips = set(quantizer.modules_to_not_convert or []) - set(exclude)
        self.op = TorchAoQuantize(quantizer)

    def quantize_param(self, key: str, value: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        # core_model_loading materialises the tensor on its device before the quantize op runs
        value = value.to(device)
        self.op.convert({key: value}, model=self.model, full_layer_name=key, missing_keys=set())
        return self.model.get_parameter(key)

    def pass_dtype(self, key: str, src_dtype: torch.dtype) -> torch.dtype:
        # core_model_loading: non-quantized tensors take the meta parameter's dtype (which is
        # `dtype` for floats created under local_torch_dtype); quantized ones are cast to `dtype`.
        return self.meta[key].dtype

    def header_metadata(self, qmeta: dict[str, str]) -> dict[str, str]:
        metadata = dict(qmeta)
        metadata["format"] = "pt"  # save_pretrained adds it after the torchao entries
        return metadata

    def index_metadata(self, total: int, qmeta: dict[str, str]) -> dict[str, int | str]:
        return {"total_parameters": self.model.num_parameters(), "total_size": total}

    def save_order(self, keys: list[str]) -> list[str]:
        # save_pretrained's revert_weight_conversion rebuilds the dict in dot_natural_key order even
        # when no conversion applies (from_pretrained leaves `_weight_conversions == []`).
        from transformers.core_model_loading import dot_natural_key

        return sorted(keys, key=dot_natural_key)

    def record_origin(self, name_or_path: str) -> None:
        self.model.config.name_or_path = name_or_path  # transformers does not save it

    def write_configs(self, dst: Path) -> list[Path]:
        # save_pretrained: the dtype of the first float parameter and the class name, then the
        # config and (for generative models) the generation config from_pretrained had loaded.
        model = self.model
        model.config.dtype = str(self.cast_dtype).split(".")[1]
        model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
        model.config.save_pretrained(dst)
        written = [dst / "config.json"]
        if model.can_generate():
            _load_generation_config(model, self.src)
            model.generation_config.save_pretrained(dst)
            written.append(dst / "generation_config.json")
        return written

    def check_keys(self, checkpoint_keys: list[str]) -> str | None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        conversions = copy.deepcopy(get_model_conversion_mapping(self.model, None, self.quantizer))
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        converters = [c for c in conversions if isinstance(c, WeightConverter)]
        prefix = self.model.base_model_prefix
        for key in checkpoint_keys:
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, self.meta)
            if renamed != key or pattern is not None:
                return f"checkpoint key {key!r} is renamed to {renamed!r} on load"
        if any(c.was_used() for c in conversions):
            return "a weight conversion of transformers applies to this checkpoint"
        return None


def _tied_keys_dropped_on_save(model: torch.nn.Module, names: list[str]) -> set[str]:
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


def _load_generation_config(model: torch.nn.Module, src: Path) -> None:
    """What from_pretrained does for generative models: its own ``adjust_generation_fn`` on the folder."""
    if hasattr(model, "adjust_generation_fn"):
        model.adjust_generation_fn(None, False, None, src, None, False, None, False, None, None, "", False)
