"""Reload one quantized component in a fresh interpreter, the way a user would, and report what came back.

Run as a *script* (``python loadpath.py REQUESTS.json``) in a fresh interpreter, so that any interpreter with
torch/torchao/diffusers/transformers can run it (``--verify-env``): it imports nothing of ``publisher``. One
interpreter takes one load path for every component of a repo, in turn (publisher/verify/workers.py). The
package imports it too (one way to load a component, one digest of a tensor, everywhere). Inputs are safetensors;
weights are safetensors, or a pickle ``.bin`` (``safe_serialization=False``) that is only ever read with
``torch.load(weights_only=True)``, as the library loaders read it.

Load paths:
- ``library``: ``<Class>.from_pretrained(folder_or_repo, subfolder=...)`` (the diffusers / transformers loaders).
- ``manual``: meta-device model (``accelerate.init_empty_weights`` + ``from_config``), every shard read
  with ``safetensors.torch.load_file``, torchao tensors rebuilt with
  metadata, then ``load_state_dict(strict=True, assign=True)``: the route without the library loaders, for
  diffusers or transformers versions whose loaders cannot read torchao tensors (see publisher/compat.py). A folder
  with pickle weights only is read with ``torch.load(weights_only=True)`` after ``import torchao`` (which allows
  its tensor classes); a pickle that loader refuses makes the path "not applicable", never a full unpickle.

The request's ``dtype`` is the dtype the model is loaded in (the one its torchao tensors record; bfloat16 by
default). An output with non-finite values is reported with the first module whose output has them, and so is a
NaN inside the model that a later kernel dropped (the output finite only by the luck of this CPU's kernels).
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "torchao", "diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out


def _model_class(library: str, class_name: str) -> Any:
    module = __import__(library)
    return getattr(module, class_name)


def load_component(library: str, class_name: str, location: Any, *, device: str = "cpu", dtype: str = "bfloat16",
                   **kwargs: Any) -> Any:
    """``<Class>.from_pretrained`` in ``dtype`` (bfloat16 unless the checkpoint was made in another), as a user would
    load one component (the package's other stages use this too, so every load goes the same way)."""
    import torch

    if device != "cpu":
        kwargs["device_map"] = device  # GPU-only layouts (int4 tile-packed) are placed as they load
    kwargs["torch_dtype" if library == "diffusers" else "dtype"] = getattr(torch, dtype)
    return _model_class(library, class_name).from_pretrained(location, **kwargs).eval()


def forward(model: Any, library: str, inputs: dict[str, Any]) -> Any:
    """The first output of one forward pass (diffusers models return a tuple with return_dict=False)."""
    import torch

    with torch.inference_mode():
        out = model(**inputs, return_dict=False) if library == "diffusers" else model(**inputs)
    return out[0]


def _load_library(req: dict[str, Any]) -> Any:
    extra = {k: req[k] for k in ("subfolder", "revision") if req.get(k)}
    return load_component(req["library"], req["class_name"], req["location"], device=req.get("device") or "cpu",
                          dtype=req.get("dtype") or "bfloat16", **extra)


def _local_folder(req: dict[str, Any]) -> Path:
    location = req["location"]
    if Path(location).is_dir():
        folder = Path(location)
    else:  # a Hub repo id: fetch the component's files (safetensors + configs only)
        from huggingface_hub import snapshot_download

        pattern = f"{req['subfolder']}/*" if req.get("subfolder") else "*"
        folder = Path(snapshot_download(location, revision=req.get("revision"), allow_patterns=[pattern]))
    return folder / req["subfolder"] if req.get("subfolder") else folder


def to_meta(v: Any) -> Any:
    """A recorded call (tensors nested in dicts, lists, tuples) with every tensor on the meta device: shapes only."""
    import torch

    if isinstance(v, torch.Tensor):
        return v.to("meta")
    if isinstance(v, dict):
        return {k: to_meta(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(to_meta(x) for x in v)
    return v


def meta_model(library: str, class_name: str, config: Any, dtype: str = "bfloat16") -> Any:
    """The component on the meta device (buffers stay real: rotary tables, position ids), from its config:
    a dict (config.json) or a transformers config object."""
    import torch
    from accelerate import init_empty_weights

    cls = _model_class(library, class_name)
    with init_empty_weights():
        if library == "diffusers":
            return cls.from_config(config)
        if isinstance(config, dict):
            config = cls.config_class.from_dict(config)
        return cls._from_config(config, dtype=getattr(torch, dtype))


class NotApplicable(Exception):
    """A load path that does not apply to this model (reported as such, not as a failure)."""


def _load_manual(req: dict[str, Any]) -> Any:
    return load_manual(req["library"], req["class_name"], _local_folder(req), dtype=req.get("dtype") or "bfloat16")


def load_manual(library: str, class_name: str, folder: Path, dtype: str = "bfloat16") -> Any:
    """The manual path (module docstring) from a local component folder, on the CPU; NotApplicable where
    transformers' key conversions cannot be reproduced by hand, or a pickle only torch's full unpickler would read."""
    cls = _model_class(library, class_name)
    config = cls.load_config(folder) if library == "diffusers" else cls.config_class.from_pretrained(folder)
    model = meta_model(library, class_name, config, dtype)
    pickled = not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin"))
    index = next(iter(folder.glob("*.bin.index.json" if pickled else "*.safetensors.index.json")), None)
    if index is not None:
        named = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(n for n in named if not (folder / n).is_file())
        if missing:
            raise FileNotFoundError(f"shard {missing[0]} named in {index.name} is missing")
    try:
        state = convert_checkpoint_keys(model, read_pickled(folder) if pickled else read_checkpoint(folder))
    except ValueError as exc:
        raise NotApplicable(str(exc)) from None
    return load_into(model, state)


def read_pickled(folder: Path) -> dict[str, Any]:
    """Every tensor of the pickle ``.bin`` files in ``folder``, read with ``torch.load(weights_only=True)`` only."""
    import pickle

    import torch
    import torchao  # noqa: F401  # registers its tensor classes with torch's weights-only loader

    state: dict[str, Any] = {}
    for shard in sorted(folder.glob("*.bin")):
        try:
            state.update(torch.load(shard, map_location="cpu", weights_only=True))
        except pickle.UnpicklingError as exc:
            first = (str(exc).strip().splitlines() or ["refused"])[0][:300]
            raise NotApplicable(f"torch's weights-only loader refuses {shard.name} ({first}); it is not unpickled "
                                "any other way") from None
    return state


# The manual path. The card's "load the weights by hand" snippet is these three functions' source, verbatim
# (publisher/stages/card.py reads it with inspect), so each imports what it needs.


def read_checkpoint(folder):
    """Every tensor of the safetensors files in ``folder``; torchao tensors rebuilt from their saved parts."""
    import json
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    shards = sorted(Path(folder).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no safetensors files in {folder}")
    tensors, metadata, names = {}, {}, []
    for shard in shards:  # a quantized tensor's parts may sit in different shards: merge, then rebuild once
        with safe_open(str(shard), framework="pt") as f:
            meta = dict(f.metadata() or {})
        names += json.loads(meta.pop("tensor_names", "[]"))
        metadata.update(meta)
        tensors.update(load_file(str(shard)))
    # torchao's helper splits every name it is given on its last dot; plain tensors need no rebuilding, and a
    # parameter at the model's top level (scale_shift_table) has no dot: give it only the torchao tensors.
    # diffusers writes the whole model's tensor_names into every shard: each name once.
    rebuilt = [n for n in dict.fromkeys(names) if json.loads(metadata[n]).get("_type") not in ("Tensor", None)]
    if not rebuilt:
        return tensors
    state, plain = unflatten_tensor_state_dict(tensors, {**metadata, "tensor_names": json.dumps(rebuilt)})
    state.update(plain)
    return state


def convert_checkpoint_keys(model, state):
    """transformers >= 5 renames and merges some checkpoint keys while loading (MoE: one tensor per expert in the
    files, one fused parameter per layer in the model). Apply the model's own rules; ValueError if one cannot be."""
    import re

    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers 4, or diffusers only: the checkpoint keys are the model's keys
        return state
    if not isinstance(model, PreTrainedModel):
        return state
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    expected = model.state_dict()
    out: dict = {}
    merged: dict = {}  # target key -> (converter, {source pattern: [tensors in expert order]})
    for key in sorted(state, key=lambda k: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", k)]):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if pattern is None:
            out[target] = state[key]
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        merged.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(state[key])
    for target, (converter, parts) in merged.items():
        for op in converter.operations:
            if type(op).__name__ not in ("MergeModulelist", "Concatenate"):
                raise ValueError(f"transformers converts {target} with {type(op).__name__}, which is not reproduced by hand")
            try:
                parts = op.convert(parts, source_patterns=converter.source_patterns, target_patterns=converter.target_patterns)
            except (RuntimeError, NotImplementedError, TypeError) as exc:  # e.g. torchao tensors cannot be stacked
                raise ValueError(f"merging the saved parts of {target} failed ({type(exc).__name__})") from None
        out[target] = next(iter(parts.values()))
    return out


def load_into(model, state):
    """``load_state_dict(assign=True)`` into the meta-device model; strict, except that a weight tied to another
    (lm_head = embed_tokens) is saved once and tied again here."""
    result = model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    still_meta = {n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}
    missing = [k for k in result.missing_keys if k in still_meta]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"state dict mismatch: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
    if still_meta:
        raise RuntimeError(f"parameters left on the meta device: {sorted(still_meta)[:3]}")
    return model


def tensor_digest(t: Any) -> str:
    """sha256 over the raw bytes of a tensor, or of every inner tensor of a torchao tensor subclass."""
    import torch

    if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        inner, _ = t.__tensor_flatten__()
        return digest_parts(type(t).__name__, [getattr(t, n) for n in inner])
    return digest_parts(None, [t])


def digest_parts(subclass: str | None, parts: list[Any]) -> str:
    """``tensor_digest`` from a tensor subclass's name and its inner tensors (in ``__tensor_flatten__`` order),
    or from a plain tensor (``subclass`` None): the streaming engine hashes what it writes this way."""
    import torch

    h = hashlib.sha256()
    if subclass is not None:
        h.update(subclass.encode())
    for p in parts:
        p = p.detach().contiguous().cpu()
        h.update(_digest_prefix(p.dtype, p.shape))
        h.update(memoryview(p.view(-1).view(torch.uint8).numpy()) if p.numel() else b"")
    return h.hexdigest()


def _digest_prefix(dtype: Any, shape: Any) -> bytes:
    return str(dtype).encode() + str(tuple(int(d) for d in shape)).encode()


def digest_header(dtype: Any, shape: Any) -> Any:
    """A sha256 primed as ``tensor_digest`` primes it for a plain tensor: feed it the raw bytes in
    order (chunk by chunk) and its hexdigest equals ``tensor_digest`` of that tensor."""
    h = hashlib.sha256()
    h.update(_digest_prefix(dtype, shape))
    return h


def linear_classes(model: Any) -> dict[str, str]:
    """The class of every Linear and Embedding weight (what torchao configs quantize), read without touching the
    data: it works on a half-loaded model."""
    import torch

    kinds = (torch.nn.Linear, torch.nn.Embedding)
    return {name: type(module.weight).__name__ for name, module in model.named_modules() if isinstance(module, kinds)}


def inspect_model(model: Any) -> dict[str, Any]:
    digests = {name: tensor_digest(t) for name, t in model.state_dict().items()}
    return {"linear_classes": linear_classes(model), "digests": digests}


def save_call(kwargs: dict[str, Any], path: Any) -> None:
    """Write one recorded call (keyword arguments) as safetensors: every tensor under its own key, and the
    structure with every other value (None, numbers, strings, tuples, lists, dicts) as JSON in the header.
    No pickle: another interpreter replays exactly that call with ``load_call``. TypeError for other values."""
    import torch
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}

    def encode(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = v.detach().cpu().contiguous()
            return {"tensor": key}
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"value": v}
        if isinstance(v, (tuple, list)):
            return {type(v).__name__: [encode(x) for x in v]}
        if isinstance(v, dict) and all(isinstance(k, str) for k in v):
            return {"dict": {k: encode(x) for k, x in v.items()}}
        raise TypeError(f"a {type(v).__name__} cannot be saved for another process")

    spec = {k: encode(v) for k, v in kwargs.items()}
    save_file(tensors, str(path), metadata={"call": json.dumps(spec)})


def load_call(path: Any, device: str = "cpu") -> dict[str, Any]:
    """The keyword arguments ``save_call`` wrote, tensors on ``device``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as fh:
        spec = json.loads((fh.metadata() or {}).get("call", "null") or "null")
    if spec is None:  # an older inputs file: plain keyword tensors
        return {k: v.to(device) for k, v in tensors.items()}

    def decode(node: dict[str, Any]) -> Any:
        (kind, v), = node.items()
        if kind == "tensor":
            return tensors[v].to(device)
        if kind == "value":
            return v
        if kind == "dict":
            return {k: decode(x) for k, x in v.items()}
        items = [decode(x) for x in v]
        return tuple(items) if kind == "tuple" else items

    return {k: decode(node) for k, node in spec.items()}


def run_forward(model: Any, library: str, inputs_file: str, output_file: str, device: str = "cpu") -> dict[str, str] | None:
    """Run the recorded call once, every leaf module watched, and save its first output. Returns None when all is
    finite; else the first module (in execution order) whose output held a NaN or an infinity, with which, and
    ``"output": "finite"`` when the model's own output is finite all the same."""
    from safetensors.torch import save_file

    inputs = load_call(inputs_file, device)
    first, found, nan = _watched_forward(model, library, inputs)
    save_file({"output": first.detach().contiguous().cpu()}, output_file)
    what = _nonfinite(first)
    if what:
        return found or {"layer": "", "what": what}
    # A NaN inside is a wrong model even when a later kernel drops it: the CPU attention kernels built for AVX-512
    # turn an all-NaN query into zeros, those for AVX2 carry the NaN on, so the output alone says pass on one CPU and
    # fail on the other. An infinity inside is left to the output: some models clamp one away by design (T5 in fp16).
    return {"layer": nan, "what": "NaN", "output": "finite"} if nan else None


def _nonfinite(t: Any) -> str | None:
    import torch

    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    return "NaN" if bool(torch.isnan(t).any()) else "inf"


def _watched_forward(model: Any, library: str, inputs: dict[str, Any]) -> tuple[Any, dict[str, str], str]:
    """``forward`` with a hook on every leaf module: (its first output, the first module whose output held a NaN
    or an infinity, with which (empty when none did), the first module whose output held a NaN ("" when none))."""
    found: dict[str, str] = {}
    nan = ""

    def hook(name: str) -> Any:
        def check(module: Any, args: Any, output: Any) -> None:
            nonlocal nan
            if nan:  # both are known: the first NaN is the first bad output or comes after it
                return
            for o in output if isinstance(output, (tuple, list)) else (output,):
                what = _nonfinite(o)
                if what and not found:
                    found.update(layer=name, what=what)
                if what == "NaN":
                    nan = name
                    return
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n and not list(m.children())]
    try:
        first = forward(model, library, inputs)
    finally:
        for h in handles:
            h.remove()
    return first, found, nan


def first_nonfinite(model: Any, library: str, inputs: dict[str, Any]) -> dict[str, str]:
    """Run the call with a forward hook on every leaf module: the first (in execution order) whose output holds
    a NaN or an infinity, with which ("layer" empty when no module's own output had them)."""
    return _watched_forward(model, library, inputs)[1] or {"layer": "", "what": "NaN"}


def _import_class(req: dict[str, Any]) -> None:
    """torch and the component's class, imported as both load paths begin (torch, then the library), with the cyclic
    GC paused; what they made is then frozen out of later collections. Otherwise every full collection during the
    load walks the objects of some 3,000 modules again: a third of a worker's CPU time on a tiny model (4.6 s -> 3.2 s
    for the tiny FLUX transformer, measured). What loads, and in which order, is the same."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401

        _model_class(req["library"], req["class_name"])
    finally:
        gc.collect()  # the imports' own garbage first: a frozen cycle would keep the frames above it, ours too
        if was:
            gc.enable()
        gc.freeze()


def run_request(req: dict[str, Any]) -> dict[str, Any]:
    """Load one component along one path, as the request says, and report what came back."""
    result: dict[str, Any] = {"path": req["path"], "component": req.get("subfolder") or "", "versions": versions()}
    model: Any = None
    try:
        _import_class(req)
        import torch

        if req.get("threads"):
            torch.set_num_threads(int(req["threads"]))
        model = _load_library(req) if req["path"] == "library" else _load_manual(req)
        # Loaded without an error: what a user would now hold. Recorded before anything else can fail, so a
        # load that "works" but leaves layers unquantized is told apart from one that raises.
        result["loaded"] = True
        result["linear_classes"] = linear_classes(model)
        model.eval()
        device = req.get("device") or "cpu"
        model.to(device)
        result.update(inspect_model(model))
        if req.get("inputs"):
            result["nonfinite"] = run_forward(model, req["library"], req["inputs"], req["output"], device)
            result["output"] = req["output"]
        result["ok"] = True
    except NotApplicable as exc:
        result["ok"] = False
        result["not_applicable"] = True
        result["error"] = str(exc).splitlines()[0][:500]
    except Exception as exc:  # reported to the parent, which decides; this process only loads and reports
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        model = None  # not held past this request, even by a frame object that outlives the call
    result["peak_rss_bytes"] = _peak_rss()
    return result


def _peak_rss() -> int | None:
    """This process's peak resident memory so far (VmHWM), in bytes; None where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(request_file: str) -> int:
    """Every request of the file (``{"requests": [...]}``: the components of one repo, one load path) in turn, in this
    one interpreter, as a user's pipeline load reads its components in one process; each model is freed before the
    next is loaded, and each result is written as soon as it is known (the parent reruns, alone, any component this
    process did not finish)."""
    import gc

    for req in json.loads(Path(request_file).read_text())["requests"]:
        result = run_request(req)
        gc.collect()  # the model went with run_request's frame; its reference cycles go now, before the next load
        Path(req["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
