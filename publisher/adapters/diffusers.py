"""diffusers' adapter: ``ModelMixin`` models, their ``from_pretrained`` and quantizer (the base class says what an
adapter is)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher.adapters.base import LibraryAdapter, is_subclass, linear_weights, save_default
from publisher.io.jsonfile import read_object

if TYPE_CHECKING:
    import torch


class DiffusersAdapter(LibraryAdapter):
    """Mirrors ``ModelMixin.from_pretrained`` (diffusers 0.42) up to the point where weights are read."""

    library = "diffusers"
    model_base = "ModelMixin"
    base_module = "diffusers.models.modeling_utils"
    keep_fp32_attr = "_keep_in_fp32_modules"
    pattern_order = "diffusers tries every pattern on the parameter fqn (….weight) before any on the module fqn"
    card_pipeline_names = ", TorchAoConfig"  # on the line that imports DiffusionPipeline

    @classmethod
    def build_meta(cls, model_cls: Any, config: dict[str, Any]) -> torch.nn.Module:
        from accelerate import init_empty_weights

        with init_empty_weights():
            model: torch.nn.Module = model_cls.from_config(config)
        return model

    @classmethod
    def kept(cls, param_name: str, patterns: list[str]) -> bool:
        # diffusers' TorchAoHfQuantizer.check_if_quantized_param rule
        return any((key + "." in param_name) or key == param_name for key in patterns)

    @classmethod
    def _pattern_tries(cls, patterns: list[str], fqns: tuple[str, str]) -> Iterable[tuple[str, str]]:
        return [(p, f) for f in fqns for p in patterns]

    @classmethod
    def loader_quantizer(cls, qconfig: Any, model: torch.nn.Module) -> Any:
        from diffusers.quantizers import DiffusersAutoQuantizer

        q = DiffusersAutoQuantizer.from_config(qconfig, pre_quantized=False)
        q.preprocess_model(model, device_map=None, keep_in_fp32_modules=list(getattr(model, "_keep_in_fp32_modules", None) or []))
        return q

    @classmethod
    def quantizes(cls, quantizer: Any, model: torch.nn.Module, param: str) -> bool:
        return bool(quantizer.check_if_quantized_param(model, None, param, {}, param_device=None))

    @classmethod
    def quantized_from_pretrained(cls, class_name: str, src: Path, ao_config: Any, exclude: list[str] | None,
                                  placement: dict[str, Any], context: AbstractContextManager[Any],
                                  origin: str) -> torch.nn.Module:
        import diffusers
        import torch

        model_cls = getattr(diffusers, class_name)
        qconf = diffusers.TorchAoConfig(ao_config, modules_to_not_convert=exclude)
        with context:
            model: Any = model_cls.from_pretrained(src, quantization_config=qconf, torch_dtype=torch.bfloat16, **placement)
        model.register_to_config(_name_or_path=origin)  # not the folder read (a cache or local path)
        return model

    def _build(self, src: Path, ao_config: object, exclude: list[str], class_name: str | None) -> None:
        import diffusers
        import torch
        from accelerate import init_empty_weights
        from diffusers.models.modeling_utils import no_init_weights
        from diffusers.quantizers import DiffusersAutoQuantizer
        from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME

        if class_name is None:
            class_name = read_object(src / "config.json").get("_class_name")
        name = class_name if isinstance(class_name, str) else None
        cls: Any = getattr(diffusers, name or "", None)
        if not is_subclass(cls, diffusers.ModelMixin):
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
        self.linear_weights = linear_weights(model)
        self.quantize_keys = {k for k in names if quantizer.check_if_quantized_param(model, sd[k], k, {}, param_device="cpu")}
        self.dropped_on_save = set()
        self.weights_name, self.index_name = SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME
        self.max_shard_size = save_default(cls)

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


def output_kind(pipeline_class: str | None) -> str:
    """"video" when the pipeline's output has ``frames``, "audio" when it has ``audios``, else "image"; read from
    the output dataclasses of the pipeline's own module."""
    import dataclasses
    import sys

    import diffusers
    from diffusers.utils import BaseOutput

    cls = getattr(diffusers, pipeline_class or "", None)
    module = sys.modules.get(getattr(cls, "__module__", ""), None)
    fields: set[str] = set()
    for obj in vars(module).values() if module else ():
        if isinstance(obj, type) and issubclass(obj, BaseOutput) and obj is not BaseOutput and dataclasses.is_dataclass(obj):
            fields |= {f.name for f in dataclasses.fields(obj)}
    return "video" if "frames" in fields else "audio" if "audios" in fields else "image"
