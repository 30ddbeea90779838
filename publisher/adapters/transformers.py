"""transformers' adapter: ``PreTrainedModel`` models, their ``from_pretrained`` and quantizer (the base class says
what an adapter is)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher.adapters.base import LibraryAdapter, is_subclass, linear_weights, save_default

if TYPE_CHECKING:
    import torch


class TransformersAdapter(LibraryAdapter):
    """Mirrors ``PreTrainedModel.from_pretrained`` (transformers 5.23) up to the point where weights are read."""

    library = "transformers"
    model_base = "PreTrainedModel"
    base_module = "transformers.modeling_utils"
    # its other list, _keep_in_fp32_modules, is for float16 only
    keep_fp32_attr = "_keep_in_fp32_modules_strict"
    renames_checkpoint_keys = True
    token_inputs = True
    entries_apply_to_whole_module = True
    pattern_order = "transformers tries each pattern on the parameter fqn, then the module fqn"
    card_pipeline_import = "from transformers import TorchAoConfig as TransformersTorchAoConfig"

    @classmethod
    def build_meta(cls, model_cls: Any, config: dict[str, Any]) -> torch.nn.Module:
        import torch
        from accelerate import init_empty_weights

        with init_empty_weights():
            model: torch.nn.Module = model_cls._from_config(model_cls.config_class.from_dict(config), dtype=torch.bfloat16)
        return model

    @classmethod
    def default_skip_modules(cls, model: torch.nn.Module) -> tuple[str, ...]:
        from transformers.quantizers.base import get_keys_to_not_convert

        return tuple(sorted(get_keys_to_not_convert(model)))

    @classmethod
    def causal_lm(cls, class_name: str) -> bool:
        return class_name.endswith(("ForCausalLM", "LMHeadModel"))

    @classmethod
    def kept(cls, param_name: str, patterns: list[str]) -> bool:
        from transformers.quantizers.quantizers_utils import should_convert_module

        return not should_convert_module(param_name, patterns)

    @classmethod
    def card_config_class(cls, in_pipeline: bool) -> str:
        # beside diffusers' own TorchAoConfig in a pipeline's snippet
        return "TransformersTorchAoConfig" if in_pipeline else "TorchAoConfig"

    @classmethod
    def _pattern_tries(cls, patterns: list[str], fqns: tuple[str, str]) -> Iterable[tuple[str, str]]:
        return [(p, f) for p in patterns for f in fqns]

    @classmethod
    def loader_quantizer(cls, qconfig: Any, model: torch.nn.Module) -> Any:
        from transformers.quantizers import AutoHfQuantizer

        q = AutoHfQuantizer.from_config(qconfig, pre_quantized=False)
        q.preprocess_model(model, checkpoint_files=None)
        return q

    @classmethod
    def quantizes(cls, quantizer: Any, model: torch.nn.Module, param: str) -> bool:
        return bool(quantizer.param_needs_quantization(model, param))

    @classmethod
    def quantized_from_pretrained(cls, class_name: str, src: Path, ao_config: Any, exclude: list[str] | None,
                                  placement: dict[str, Any], context: AbstractContextManager[Any],
                                  origin: str) -> torch.nn.Module:
        # origin: transformers does not save the path a model was loaded from
        import torch
        import transformers
        from accelerate import init_empty_weights

        model_cls = getattr(transformers, class_name)
        if exclude:
            # transformers drops its default skips (lm_head, tied embeddings) once a list is
            # given; keep them, as the user only asked for more exclusions
            with init_empty_weights():
                meta = model_cls._from_config(model_cls.config_class.from_pretrained(src))
            exclude = sorted(set(cls.default_skip_modules(meta)) | set(exclude))
        qconf = transformers.TorchAoConfig(ao_config, modules_to_not_convert=exclude)
        with context:
            model: torch.nn.Module = model_cls.from_pretrained(src, quantization_config=qconf, dtype=torch.bfloat16, **placement)
        return model

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
        if not is_subclass(cls, transformers.PreTrainedModel):
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
        self.linear_weights = linear_weights(model)
        self.quantize_keys = {k for k in names if quantizer.param_needs_quantization(model, k)}
        self.dropped_on_save = _tied_keys_dropped_on_save(model, names) | (set(model._keys_to_ignore_on_save or ()) & set(names))
        self.weights_name, self.index_name = SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME
        self.max_shard_size = save_default(cls)
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
