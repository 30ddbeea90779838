"""What a `verify TARGET` holds: every layout a torchao checkpoint comes in, and the base it names.

- a diffusers pipeline (``model_index.json``): each component whose ``config.json`` carries a torchao
  ``quantization_config``;
- a standalone diffusers model folder (``model.save_pretrained(dir)``: a ``config.json`` with ``_class_name``, no
  ``model_index.json``): the class is the one ``_class_name`` names;
- a transformers model folder (``config.json`` with ``architectures``).

Each component's weights are safetensors (sharded or not) or a pickle ``.bin`` (``safe_serialization=False``),
which is read only with ``torch.load(weights_only=True)``. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from publisher import adapters
from publisher.errors import SourceError
from publisher.io.jsonfile import read_object
from publisher.io.localfiles import allowed_roots, plain_name
from publisher.streaming.safetensors_io import read_header

SAFETENSORS = "safetensors"
PICKLE = "pickle"


@dataclass
class TargetComponent:
    name: str  # the folder of a pipeline component; "" for a model at the root
    library: str  # "diffusers" | "transformers"
    class_name: str
    config: dict[str, Any]

    @property
    def label(self) -> str:
        return self.name or "model"

    @property
    def quantization(self) -> dict[str, Any]:
        return self.config.get("quantization_config") or {}


def read_json(folder: Path, path: str) -> dict[str, Any] | None:
    """A JSON file of the (local copy of the) target, through the one JSON reader; None if absent."""
    p = folder / path
    return read_object(p, roots=allowed_roots(folder)) if p.is_file() else None


def is_torchao(config: dict[str, Any]) -> bool:
    return isinstance(config.get("quantization_config"), dict) and config["quantization_config"].get("quant_method") == "torchao"


def diffusers_model(config: dict[str, Any]) -> bool:
    """A diffusers model's config.json (``ModelMixin.save_pretrained``) rather than a transformers one."""
    return "_class_name" in config or "_diffusers_version" in config


def model_class(config: dict[str, Any], where: str) -> tuple[str, str]:
    """(library, class name) of the model a config.json describes."""
    if diffusers_model(config):
        name = config.get("_class_name")
        if not isinstance(name, str) or not name.isidentifier():
            raise SourceError(f"{where}: _class_name is {name!r}, not a diffusers model class; fix the file")
        return "diffusers", name
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) and a.isidentifier() for a in archs):
        raise SourceError(f"{where} names no model class (architectures is {archs!r}); add the transformers class that "
                          "loads it to architectures")
    return "transformers", archs[0]


def components(folder: Path, target: str) -> list[TargetComponent]:
    """The torchao-quantized components of the target whose (local copy of its) configs are in ``folder``."""
    index = read_json(folder, "model_index.json")
    found: list[TargetComponent] = []
    models: list[str] = []  # every model folder, to say what the target holds when nothing is torchao
    if index:
        for name, value in index.items():
            if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or value[0] not in adapters.LIBRARIES:
                continue
            if not plain_name(name) or not isinstance(value[1], str):
                raise SourceError(f"{target}/model_index.json names a component {name!r} ({value!r}) that is not a "
                                  "plain folder name and class; refusing to read it")
            cfg = read_json(folder, f"{name}/config.json")
            if cfg is None:
                continue  # a tokenizer, a scheduler
            models.append(name)
            if is_torchao(cfg):
                found.append(TargetComponent(name, value[0], value[1], cfg))
    else:
        cfg = read_json(folder, "config.json")
        if not cfg:
            raise SourceError(f"{target} is neither a diffusers pipeline (model_index.json) nor a model folder (config.json)")
        models.append("")
        if is_torchao(cfg):
            library, class_name = model_class(cfg, f"{target}/config.json")
            found.append(TargetComponent("", library, class_name, cfg))
    if not found:
        raise SourceError(_nothing_declared(folder, target, models))
    for comp in found:
        _check_class(comp, target)
    return found


def _check_class(comp: TargetComponent, target: str) -> None:
    """The library of this environment has the component's model class (else no load path can run)."""
    import importlib.metadata as md

    import torch

    cls = getattr(__import__(comp.library), comp.class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise SourceError(f"{target}{'/' + comp.name if comp.name else ''} is a {comp.class_name}, which {comp.library} "
                          f"{md.version(comp.library)} has no model class for; upgrade {comp.library}, or fix the class name "
                          "in its config")


def _nothing_declared(folder: Path, target: str, models: list[str]) -> str:
    """Why the target has no torchao component, as precisely as its local files tell."""
    for name in models:
        cfg = read_json(folder, f"{name}/config.json" if name else "config.json") or {}
        method = (cfg.get("quantization_config") or {}).get("quant_method") if isinstance(cfg.get("quantization_config"), dict) else None
        where = f"{target}/{name + '/' if name else ''}config.json"
        if method:
            return (f"{where} declares quant_method {method!r}, not torchao; hf-ao-publish verify checks torchao "
                    "checkpoints only")
        if torchao_tensors(folder / name if name else folder):
            return (f"{target}{'/' + name if name else ''} holds torchao tensors, but {where} declares no "
                    "quantization_config; the library loaders would not rebuild them: add the quantization_config "
                    "they were made with")
    return f"{target} has no torchao-quantized component (no quantization_config with quant_method torchao)"


def torchao_tensors(folder: Path) -> bool:
    """Whether a local component folder's safetensors headers record torchao tensor subclasses (header only)."""

    for shard in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        metadata = read_header(shard)[0]
        for key, value in metadata.items():
            if key != "tensor_names" and isinstance(value, str) and value.startswith("{") and '"_type"' in value:
                try:
                    if json.loads(value).get("_type") not in ("Tensor", None):
                        return True
                except ValueError:
                    continue
    return False


def weight_format(folder: Path) -> str | None:
    """``safetensors`` when the folder has safetensors weights (loaders prefer them), else ``pickle`` for ``.bin``."""
    if any(folder.glob("*.safetensors")):
        return SAFETENSORS
    if any(folder.glob("*.bin")):
        return PICKLE
    return None


def declared_base(folder: Path, state: dict[str, Any] | None) -> tuple[str | None, str]:
    """The base the target names (``base_model`` of our hf_ao_publish.json, else of its card), and where it is named."""
    if state and isinstance(state.get("base_model"), str):
        return state["base_model"], "its hf_ao_publish.json"
    card = folder / "README.md"
    if card.is_file():
        from huggingface_hub import ModelCard

        try:
            data = ModelCard(card.read_text(encoding="utf-8", errors="replace"), ignore_metadata_errors=True).data.to_dict()
        except ValueError:
            data = {}
        base = data.get("base_model")
        if isinstance(base, list) and len(base) == 1:
            base = base[0]
        if isinstance(base, str) and base:
            return base, "its card (base_model)"
    return None, ""
