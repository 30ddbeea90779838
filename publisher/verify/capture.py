"""Forward inputs derived from the base itself, for every family: no per-family table to maintain.

Pipelines: the base pipeline runs at a tiny size for one step. A forward pre-hook on the denoiser records its
call (positional arguments bound to their names) and stops the run by raising before any denoiser weight is
used: the denoiser is built on the meta device and never loaded. Quantized components the pipeline calls on
the way (text encoders) have their first call recorded too. The recorded call is checked on the meta device
(shapes only, free); if it does not fit there, the run is repeated with the pipeline's own default prompt
length. Transformers models the pipeline did not call, and causal LMs, get token ids from their forward
signature and config (verify/inputs.py). Each call is saved with ``loadpath.save_call`` so the fresh-process
load paths replay exactly that call. What cannot be run gets "weights only" and the reason.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path
from typing import Any

from publisher import adapters, loadpath
from publisher.handoffs.plan import DENOISERS, Plan
from publisher.handoffs.report import ForwardInputs
from publisher.verify.inputs import token_inputs

log = logging.getLogger(__name__)


PROMPT = "a photo of a cat"


class _Recorded(Exception):
    """Raised by the denoiser's pre-hook: the call is recorded, the rest of the run is not needed."""


def prepare(plan: Plan, base_dir: Path, work: Path) -> dict[str, ForwardInputs]:
    """The forward inputs of every quantized component of the plan (by component name), saved under ``work``."""
    quantized = {c.name: (c.library, c.class_name) for c in plan.quantized}
    return for_components(base_dir, plan.pipeline_class if plan.kind == "pipeline" else None, quantized, work)


def for_components(folder: Path, pipeline_class: str | None, quantized: dict[str, tuple[str, str]],
                   work: Path) -> dict[str, ForwardInputs]:
    """The forward inputs of ``quantized`` (component name -> (library, class name)) of the model in ``folder``: a
    pipeline (``pipeline_class``) or a transformers model (None; its component name is "")."""
    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, ForwardInputs] = {}
    if pipeline_class:
        out.update(_from_pipeline(folder, pipeline_class, set(quantized), work))
    for name, (library, class_name) in quantized.items():
        if name in out:
            continue
        if not adapters.of(library).token_inputs:
            why = (f"the {pipeline_class} run does not call {name}'s forward before its denoiser" if pipeline_class else
                   f"a standalone {class_name} has no pipeline whose call could be recorded for it")
            out[name] = ForwardInputs(None, "", why)
            continue
        config = json.loads(((folder / name if name else folder) / "config.json").read_text())
        inputs, how = token_inputs(class_name, config)
        out[name] = _saved(inputs, how, work / f"inputs-{name or 'model'}.safetensors")
    return out


def _saved(inputs: dict[str, Any] | None, how: str, path: Path) -> ForwardInputs:
    if inputs is None:
        return ForwardInputs(None, "", how)
    try:
        loadpath.save_call(inputs, path)
    except TypeError as exc:
        return ForwardInputs(None, "", f"the recorded call cannot be replayed in another process ({exc})")
    return ForwardInputs(path, how)


def _from_pipeline(folder: Path, pipeline_class: str, wanted: set[str], work: Path) -> dict[str, ForwardInputs]:
    index = json.loads((folder / "model_index.json").read_text())
    denoisers: list[str] = [n for n in DENOISERS if isinstance(index.get(n), list) and index[n][0] is not None]
    if not denoisers:
        return {}
    try:
        pipe, metas = build_pipeline(folder, pipeline_class, denoisers[0])
    except (OSError, ValueError, TypeError, AttributeError, ImportError, RuntimeError) as exc:
        why = f"building {pipeline_class} to record its calls failed ({_first_line(exc)})"
        return {n: ForwardInputs(None, "", why) for n in wanted if n in DENOISERS}
    recorded, failure = _record(pipe, metas, wanted)
    out: dict[str, ForwardInputs] = {}
    for name, (kwargs, how) in recorded.items():
        if _has_meta(kwargs):  # a model whose weights are not on disk (--low-disk) is on the meta device, and the
            continue           # pipeline moves its inputs there: a text encoder then gets seeded token ids (below)
        out[name] = _saved(kwargs, how, work / f"inputs-{name}.safetensors")
    for name in wanted - set(recorded):
        if name in DENOISERS:
            out[name] = ForwardInputs(None, "", failure or f"{pipeline_class} never called {name}")
    return out


def build_pipeline(folder: Path, pipeline_class: str, denoiser: str) -> tuple[Any, dict[str, Any]]:
    """The pipeline in ``folder`` with its denoiser on the meta device (never loaded); every other model in bfloat16,
    or on the meta device where its weights are not on disk (--low-disk). Returns the pipeline and its meta models."""
    import diffusers
    import torch

    index = json.loads((folder / "model_index.json").read_text())
    cls = getattr(diffusers, pipeline_class)
    params = inspect.signature(cls.__init__).parameters
    components: dict[str, Any] = {}
    metas: dict[str, Any] = {}
    for name, value in index.items():
        if name.startswith("_") or name not in params:
            continue
        if not isinstance(value, list) or len(value) != 2:
            components[name] = value  # a pipeline setting (boundary_ratio, requires_safety_checker...)
            continue
        library, class_name = value
        if library is None or class_name is None:
            components[name] = None
            continue
        module = getattr(diffusers.pipelines, library, None) or __import__(library)
        component_cls: Any = getattr(module, class_name)
        if not (isinstance(component_cls, type) and issubclass(component_cls, torch.nn.Module)):
            components[name] = component_cls.from_pretrained(folder / name)  # tokenizer, scheduler, processor
        elif name == denoiser or not any((folder / name).glob("*.safetensors")):
            metas[name] = components[name] = _meta(component_cls, folder / name)
            if name != denoiser:  # weights not read (--low-disk: copied Hub to Hub): seeded outputs of its shapes
                _stand_in(components[name], name)
        else:
            dtype = {"torch_dtype" if issubclass(component_cls, diffusers.ModelMixin) else "dtype": torch.bfloat16}
            loader: Any = component_cls
            components[name] = loader.from_pretrained(folder / name, **dtype).eval()
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    # The pipeline takes its device from its first model, which may be on the meta device here.
    pipe.__class__ = type(cls.__name__, (cls,), {"_execution_device": property(lambda self: torch.device("cpu")),
                                                 "device": property(lambda self: torch.device("cpu"))})
    return pipe, metas


def _stand_in(model: Any, name: str) -> None:
    """Make a meta-device model (a text encoder whose weights this run never reads) answer with seeded values in
    the shapes and dtypes its real forward would give: the denoiser's recorded call is then real tensors (its
    forward check is as exact; its quality figure is on stand-in embeddings, which ``how`` says)."""
    import torch

    forward = model.forward
    gen = torch.Generator().manual_seed(sum(name.encode()))

    def real(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_meta:
            if v.is_floating_point():
                return torch.randn(v.shape, generator=gen).to(v.dtype)
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, dict):  # a ModelOutput too (an OrderedDict): set item by item, it keeps its class
            for k in list(v.keys()):
                v[k] = real(v[k])
            return v
        if isinstance(v, (list, tuple)):
            return type(v)(real(x) for x in v)
        return v

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return real(forward(*loadpath.to_meta(args), **loadpath.to_meta(kwargs)))

    model.forward = stand_in
    model.hf_ao_publish_stand_in = True


def _meta(cls: Any, folder: Path) -> Any:
    """The model on the meta device, in the dtype it is loaded in (bfloat16): a run may read its dtype."""
    import diffusers
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights():
        if issubclass(cls, diffusers.ModelMixin):
            return torch.nn.Module.to(cls.from_config(cls.load_config(folder)), torch.bfloat16)
        return cls._from_config(cls.config_class.from_pretrained(folder), dtype=torch.bfloat16)


def _call_kwargs(pipe: Any, size: int, short_prompt: bool) -> dict[str, Any]:
    """One step at ``size`` px; guidance off (one batch row); a short prompt where the pipeline allows it."""
    import torch

    params = inspect.signature(type(pipe).__call__).parameters
    kwargs: dict[str, Any] = {"prompt": PROMPT, "num_inference_steps": 1, "generator": torch.Generator().manual_seed(0)}
    optional = {"height": size, "width": size, "guidance_scale": 1.0, "max_area": size * size,
                "use_resolution_binning": False, "output_type": "latent", "num_frames": 9}
    if short_prompt:
        optional["max_sequence_length"] = 16
    kwargs.update({k: v for k, v in optional.items() if k in params})
    return kwargs


def _spatial_factor(pipe: Any) -> int:
    for attr in ("vae_scale_factor_spatial", "vae_spatial_compression_ratio", "vae_scale_factor"):
        value = getattr(pipe, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 8


def _record(pipe: Any, metas: dict[str, Any], wanted: set[str]) -> tuple[dict[str, tuple[dict[str, Any], str]], str | None]:
    """Run the pipeline until its denoiser is called; returns {component: (call, how)} and why nothing was recorded."""
    import torch

    denoiser = next(n for n in DENOISERS if n in metas)
    size = max(32, 4 * _spatial_factor(pipe))
    error = None
    for attempt, (scale, short) in enumerate(((1, True), (1, False), (2, False), (4, False))):
        calls: dict[str, dict[str, Any]] = {}
        handles = [getattr(pipe, n).register_forward_pre_hook(_hook(getattr(pipe, n), n, calls, n == denoiser),
                                                              with_kwargs=True, prepend=True)
                   for n in wanted | {denoiser} if isinstance(getattr(pipe, n, None), torch.nn.Module)]
        kwargs = _call_kwargs(pipe, size * scale, short)
        try:
            with torch.inference_mode():
                pipe(**kwargs)
            error = f"{type(pipe).__name__} finished without calling {denoiser}"
        except _Recorded:
            error = None
        except Exception as exc:  # the pipeline's own checks (sizes, frames): try the next size; reported if none fits
            error = f"running {type(pipe).__name__} to record the {denoiser}'s call failed ({_first_line(exc)})"
        finally:
            for h in handles:
                h.remove()
        if error is not None or denoiser not in calls:
            continue
        if short and attempt == 0 and not _fits_on_meta(metas[denoiser], calls[denoiser]):
            continue  # e.g. a position table sized for the default prompt length: record again with that length
        shape = "x".join(str(kwargs[k]) for k in ("height", "width") if k in kwargs)
        frames = f", {kwargs['num_frames']} frames" if "num_frames" in kwargs else ""
        stand_ins = sorted(n for n, m in metas.items() if getattr(m, "hf_ao_publish_stand_in", False))
        how = (f"the call {type(pipe).__name__} makes at {shape or 'its default'} px{frames}, 1 step, seeded "
               f"(recorded with a forward hook)" + (f", with seeded stand-ins for the outputs of {', '.join(stand_ins)} "
                                                    "(their weights go Hub to Hub, unread)" if stand_ins else ""))
        return {n: (c, how) for n, c in calls.items() if n in wanted}, None
    return {}, error


def _has_meta(v: Any) -> bool:
    import torch

    if isinstance(v, torch.Tensor):
        return bool(v.is_meta)
    if isinstance(v, dict):
        return any(_has_meta(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_has_meta(x) for x in v)
    return False


def _hook(model: Any, name: str, calls: dict[str, dict[str, Any]], stop: bool) -> Any:
    signature = inspect.signature(model.forward)

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name not in calls:
            bound = signature.bind_partial(*args, **kwargs).arguments
            call: dict[str, Any] = {}
            for k, v in bound.items():  # **kwargs of the forward: their items are keyword arguments of the call
                call.update(v if signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD else {k: v})
            call.pop("return_dict", None)  # the load paths set it themselves
            calls[name] = call
        if stop:
            raise _Recorded()

    return hook


def _fits_on_meta(model: Any, call: dict[str, Any]) -> bool:
    """Run the denoiser on the meta device with the recorded call: shapes only, no memory, no time. False when it
    raises (some models also call .item() on an input, which the meta device cannot do; the default prompt length
    is then used, which the pipeline itself would use)."""
    import torch

    model.to("meta")  # buffers too: nothing may mix devices
    try:
        with torch.inference_mode():
            model(**loadpath.to_meta(call), return_dict=False)
    except Exception:  # any failure means "not proven to fit": fall back to the pipeline's defaults
        return False
    return True


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
