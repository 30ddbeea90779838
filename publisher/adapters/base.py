"""What every library adapter offers: the facts and calls that differ between diffusers and transformers, and the
streaming engine's meta-device model built the way the library's ``from_pretrained`` builds it.

The class-level part (facts and classmethods) needs no model: the planner, the card, verification and the evaluation
ask it with a component's library name (``adapters.of``). An instance is the streaming engine's component: a
meta-device model with the quantizer ``from_pretrained`` would create. Bit-identity with the documented library path
comes from *reusing* the libraries' own code, not from re-implementing it: that quantizer decides which parameters
get quantized (``check_if_quantized_param`` / ``param_needs_quantization``: exclusions, keep-in-fp32 modules,
transformers' default skips), quantizes them (``create_quantized_param`` / ``TorchAoQuantize.convert``, i.e. torchao's
``quantize_`` on the model's own ``nn.Linear``), flattens the state dict (``get_state_dict_and_metadata``) and writes
config.json. Only the loops around those calls (read a tensor, cast it, write it) are ours, and they follow the
loaders' dtype rules, quoted next to each rule.

Torch and the libraries are imported inside the methods, so importing an adapter is free.
"""

from __future__ import annotations

import importlib
import inspect
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from publisher.configs.render import canonical

if TYPE_CHECKING:
    import torch


class LibraryAdapter(ABC):
    """One library's behaviour (as diffusers' quantizers are one class per method behind one base class).

    An instance is a meta-device model built the way the library's ``from_pretrained`` builds it, plus the hooks the
    streaming engine calls for one component: built from the component folder ``src``, the torchao config it is
    quantized with (``ao_config``: one ``AOBaseConfig``, or an ``FqnToConfig`` table), the modules kept by ``exclude``
    and the model class (default: what config.json names).
    """

    library: ClassVar[str]  # the name model_index.json and our hand-offs give the library (and its import name)
    model_base: ClassVar[str]  # the library's base class of every model it loads (``ModelMixin``, ``PreTrainedModel``)
    # the module of that base class: what every load of the library imports first (a load-path zygote's preload)
    base_module: ClassVar[str]
    # the class attribute listing the modules ``from_pretrained(dtype=torch.bfloat16)`` keeps in float32
    keep_fp32_attr: ClassVar[str]
    # the library renames or merges checkpoint keys while loading (the manual load path applies its rules too)
    renames_checkpoint_keys: ClassVar[bool] = False
    # a model's forward inputs can be made from its signature and config (token ids), without a pipeline run; the
    # perplexity evaluation reads such models
    token_inputs: ClassVar[bool] = False
    # an FqnToConfig entry applies to every parameter of the module it matches (biases included), and a lone module
    # is quantized with quantize_'s filter_fn "always"; otherwise to Linear weights only
    entries_apply_to_whole_module: ClassVar[bool] = False
    pattern_order: ClassVar[str]  # the order the library tries an FqnToConfig table's patterns, in words
    # the card's import of the library's TorchAoConfig in a pipeline snippet: names added to the diffusers line, or
    # a line of its own
    card_pipeline_names: ClassVar[str] = ""
    card_pipeline_import: ClassVar[str] = ""

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

    # -- the library's facts, asked without a model ------------------------------------------------------------------

    @classmethod
    def model_class(cls, class_name: str) -> Any:
        """The library's model class of that name, or None when it names none (a tokenizer, a scheduler...)."""
        library = importlib.import_module(cls.library)
        model_cls = getattr(library, class_name, None)
        base = getattr(library, cls.model_base)
        return model_cls if isinstance(model_cls, type) and issubclass(model_cls, base) else None

    @classmethod
    @abstractmethod
    def build_meta(cls, model_cls: Any, config: dict[str, Any]) -> torch.nn.Module:
        """``model_cls`` on the meta device from its config.json, in bfloat16, as the plan reads its structure."""

    @classmethod
    def default_skip_modules(cls, model: torch.nn.Module) -> tuple[str, ...]:
        """The modules the library keeps unquantized by default (output heads, tied embeddings), sorted."""
        return ()

    @classmethod
    def causal_lm(cls, class_name: str) -> bool:
        """Whether ``class_name`` is a causal language model (the card loads it with AutoModelForCausalLM)."""
        return False

    @classmethod
    @abstractmethod
    def kept(cls, param_name: str, patterns: list[str]) -> bool:
        """Whether the library keeps ``param_name`` out of quantization given its not-to-convert ``patterns``
        (--exclude, and transformers' defaults such as lm_head): the library's own rule."""

    @classmethod
    def card_config_class(cls, in_pipeline: bool) -> str:
        """The name the card's snippet gives the library's TorchAoConfig."""
        return "TorchAoConfig"

    @classmethod
    def resolve_key(cls, table: Mapping[str, Any], param: str) -> str | None:
        """The key of the ``FqnToConfig`` table entry the library applies to ``param`` (None: none applies): the exact
        parameter fqn, the exact module fqn, the ``re:`` patterns (in ``pattern_order``), then ``_default``; a None
        config leaves the layer alone (their own code: transformers/integrations/torchao.py, diffusers'
        _resolve_fqn_to_config)."""
        module = param.rsplit(".", 1)[0] if "." in param else ""
        for fqn in (param, module):
            if fqn in table:
                return fqn
        patterns = [p for p in table if p.startswith("re:")]
        for pattern, fqn in cls._pattern_tries(patterns, (param, module)):
            if re.fullmatch(pattern[3:], fqn):
                return pattern
        return "_default" if "_default" in table else None

    @classmethod
    def resolve(cls, table: Mapping[str, Any], param: str) -> tuple[Any, str]:
        """(config, where it comes from): see ``resolve_key``."""
        key = cls.resolve_key(table, param)
        if key is None:
            return None, "no entry and no _default"
        return table[key], ("its _default" if key == "_default" else f"its pattern {key!r}" if key.startswith("re:")
                            else f"its entry {key!r}")

    @classmethod
    @abstractmethod
    def _pattern_tries(cls, patterns: list[str], fqns: tuple[str, str]) -> Iterable[tuple[str, str]]:
        """(pattern, fqn) pairs in the order the library tries them; ``fqns``: (parameter fqn, module fqn)."""

    @classmethod
    @abstractmethod
    def loader_quantizer(cls, qconfig: Any, model: torch.nn.Module) -> Any:
        """The library's own quantizer for its ``qconfig`` (a TorchAoConfig), prepared on the meta-device ``model`` as
        its loader would prepare it."""

    @classmethod
    @abstractmethod
    def quantizes(cls, quantizer: Any, model: torch.nn.Module, param: str) -> bool:
        """Whether ``quantizer`` (``loader_quantizer``) would quantize ``param`` while loading an unquantized base."""

    @classmethod
    @abstractmethod
    def quantized_from_pretrained(cls, class_name: str, src: Path, ao_config: Any, exclude: list[str] | None,
                                  placement: dict[str, Any], context: AbstractContextManager[Any],
                                  origin: str) -> torch.nn.Module:
        """The documented library path: ``from_pretrained(src, quantization_config=TorchAoConfig(ao_config, ...))``
        in bfloat16 (``placement``: its device_map, ``context`` around the call), recording ``origin`` as the base."""

    # -- an instance: the streaming engine's meta-device model -------------------------------------------------------

    def __init__(self, src: Path, ao_config: object, exclude: list[str], class_name: str | None) -> None:
        self.src = src
        self.default_skips = set()
        self._build(src, ao_config, exclude, class_name)
        self.meta_params = dict(self.model.named_parameters(remove_duplicate=False))
        self._key_of = self._config_key(ao_config)

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

    @classmethod
    def _config_key(cls, ao_config: object) -> Callable[[str], str]:
        """For an ``FqnToConfig``: the identity of the entry the library applies to a key (``resolve``)."""
        table = getattr(ao_config, "fqn_to_config", None)
        if type(ao_config).__name__ != "FqnToConfig" or not isinstance(table, dict):
            return lambda key: ""

        def key_of(key: str) -> str:
            config = cls.resolve(table, key)[0]
            return canonical(config) if config is not None else "none"

        return key_of


def linear_weights(model: torch.nn.Module) -> set[str]:
    """The state-dict keys that are the weight of an ``nn.Linear``."""
    import torch

    return {f"{name}.weight" if name else "weight" for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear)}


def is_subclass(cls: object, base: type) -> bool:
    """A named class of the library (a bool, so ``cls`` keeps its dynamic type for what follows)."""
    return inspect.isclass(cls) and issubclass(cls, base)


def save_default(cls: Any) -> int | str:
    """``save_pretrained``'s default ``max_shard_size`` for the model class ``cls``."""
    default: int | str = inspect.signature(cls.save_pretrained).parameters["max_shard_size"].default
    return default
