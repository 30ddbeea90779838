"""Reload one quantized component in a fresh interpreter, the way a user would, and report what came back.

Run as a *script* (``python loadpath.py REQUEST.json``) in a fresh interpreter, so that any interpreter with
torch/torchao/diffusers/transformers can run it (``--verify-env``): it imports nothing of ``publisher``. The
package imports it too (one way to load a component, one digest of a tensor, everywhere). It never unpickles anything: inputs are safetensors, weights are
safetensors, and the library loaders run with their default ``weights_only=True``.

Load paths:
- ``library``: ``<Class>.from_pretrained(folder_or_repo, subfolder=...)`` (torch >= 2.6 route).
- ``manual``: meta-device model (``accelerate.init_empty_weights`` + ``from_config``), every shard read
  with ``safetensors.torch.load_file``, torchao tensors rebuilt with
  ``torchao.prototype.safetensors.safetensors_support.unflatten_tensor_state_dict`` from the header
  metadata, then ``load_state_dict(strict=True, assign=True)`` (the documented torch <= 2.6 route).
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


def load_component(library: str, class_name: str, location: Any, *, device: str = "cpu", **kwargs: Any) -> Any:
    """``<Class>.from_pretrained`` in bfloat16, as a user would load one component (the package's
    other stages use this too, so every load goes the same way)."""
    import torch

    if device != "cpu":
        kwargs["device_map"] = device  # GPU-only layouts (int4 tile-packed) are placed as they load
    kwargs["torch_dtype" if library == "diffusers" else "dtype"] = torch.bfloat16
    return _model_class(library, class_name).from_pretrained(location, **kwargs).eval()


def forward(model: Any, library: str, inputs: dict[str, Any]) -> Any:
    """The first output of one forward pass (diffusers models return a tuple with return_dict=False)."""
    import torch

    with torch.inference_mode():
        out = model(**inputs, return_dict=False) if library == "diffusers" else model(**inputs)
    return out[0]


def _load_library(req: dict[str, Any]) -> Any:
    extra = {k: req[k] for k in ("subfolder", "revision") if req.get(k)}
    return load_component(req["library"], req["class_name"], req["location"], device=req.get("device") or "cpu", **extra)


def _local_folder(req: dict[str, Any]) -> Path:
    location = req["location"]
    if Path(location).is_dir():
        folder = Path(location)
    else:  # a Hub repo id: fetch the component's files (safetensors + configs only)
        from huggingface_hub import snapshot_download

        pattern = f"{req['subfolder']}/*" if req.get("subfolder") else "*"
        folder = Path(snapshot_download(location, revision=req.get("revision"), allow_patterns=[pattern]))
    return folder / req["subfolder"] if req.get("subfolder") else folder


def meta_model(library: str, class_name: str, config: Any) -> Any:
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
        return cls._from_config(config, dtype=torch.bfloat16)


def _load_manual(req: dict[str, Any]) -> Any:
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    folder = _local_folder(req)
    cls = _model_class(req["library"], req["class_name"])
    config = cls.load_config(folder) if req["library"] == "diffusers" else cls.config_class.from_pretrained(folder)
    model = meta_model(req["library"], req["class_name"], config)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no safetensors files in {folder}")
    index = next(iter(folder.glob("*.safetensors.index.json")), None)
    if index is not None:
        named = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(n for n in named if not (folder / n).is_file())
        if missing:
            raise FileNotFoundError(f"shard {missing[0]} named in {index.name} is missing")
    tensors: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    names: list[str] = []
    for shard in shards:
        # A quantized tensor's parts may sit in different shards: merge everything, then unflatten once.
        with safe_open(str(shard), framework="pt") as fh:
            meta = dict(fh.metadata() or {})
        names.extend(json.loads(meta.pop("tensor_names", "[]")))
        metadata.update(meta)
        tensors.update(load_file(str(shard)))
    if names:
        # every shard lists every tensor name: once each, or torchao's unflatten meets a name twice (KeyError)
        metadata["tensor_names"] = json.dumps(list(dict.fromkeys(names)))
        state, leftover = unflatten_tensor_state_dict(tensors, metadata)
        state.update(leftover)
    else:
        state = tensors
    result = model.load_state_dict(state, strict=False, assign=True)
    # Tied weights (e.g. lm_head = embed_tokens) are saved once; strict=True is applied to the rest.
    tied = set()
    if hasattr(model, "tie_weights"):
        model.tie_weights()
        tied = {k for k in result.missing_keys if not model.get_parameter(k).is_meta}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"state dict mismatch: missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}")
    meta_left = [n for n, p in model.named_parameters() if p.is_meta]
    if meta_left:
        raise RuntimeError(f"parameters left on the meta device: {meta_left[:3]}")
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


def inspect_model(model: Any) -> dict[str, Any]:
    import torch

    classes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            classes[name] = type(module.weight).__name__
    digests = {name: tensor_digest(t) for name, t in model.state_dict().items()}
    return {"linear_classes": classes, "digests": digests}


def run_forward(model: Any, library: str, inputs_file: str, output_file: str, device: str = "cpu") -> None:
    from safetensors.torch import load_file, save_file

    inputs = {k: v.to(device) for k, v in load_file(inputs_file).items()}
    first = forward(model, library, inputs)
    save_file({"output": first.detach().contiguous().cpu()}, output_file)


def main(request_file: str) -> int:
    req = json.loads(Path(request_file).read_text())
    result: dict[str, Any] = {"path": req["path"], "component": req.get("subfolder") or "", "versions": versions()}
    try:
        import torch

        if req.get("threads"):
            torch.set_num_threads(int(req["threads"]))
        model = _load_library(req) if req["path"] == "library" else _load_manual(req)
        model.eval()
        device = req.get("device") or "cpu"
        model.to(device)
        result.update(inspect_model(model))
        if req.get("inputs"):
            run_forward(model, req["library"], req["inputs"], req["output"], device)
            result["output"] = req["output"]
        result["ok"] = True
    except Exception as exc:  # reported to the parent, which decides; this process only loads and reports
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(req["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
