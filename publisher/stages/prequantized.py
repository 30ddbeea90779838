"""Plan time: refuse a base that is already quantized, before any weight is downloaded (issue 22).

Quantizing a quantized model again either fails deep inside a library (transformers raises with an empty reason)
or, for a pipeline, "verifies" a copy of the quantized folder against itself and publishes it with the quantized
repo as its base_model. Two signs are read, both from files the plan reads anyway (configs, and safetensors headers
read by range for a Hub base):

- a ``quantization_config`` in any component's ``config.json`` (any method: torchao, bitsandbytes, GPTQ...);
- quantized tensors in its weights: torchao tensor subclasses in the header metadata, the tensor names other
  quantizers write (``qweight``, ``SCB``, ``absmax``, ``weight_scale``...), or float8 / int8 weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from publisher.errors import SourceError
from publisher.handoffs.plan import Source
from publisher.stages.basecheck import Header
from publisher.stages.source import read_json

# names other quantizers give the parts of a quantized weight (bitsandbytes, GPTQ/AWQ, compressed-tensors, fbgemm fp8)
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".SCB", ".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4",
                      ".quant_state.bitsandbytes__fp4", ".weight_scale", ".weight_scale_inv", ".weight_zero_point",
                      ".weight_packed", ".input_scale")
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2", "I8", "U8")


def refuse_quantized_configs(source: Source, folders: Iterable[str], token: str | None) -> None:
    """SourceError when a model folder's config.json declares a quantization_config."""
    for folder in folders:
        path = f"{folder}/config.json" if folder else "config.json"
        if path not in source.sizes:
            continue
        declared = read_json(source, path, token).get("quantization_config")
        if isinstance(declared, dict) and declared:
            method = declared.get("quant_method") or "an unnamed method"
            what = _torchao_type(declared) if method == "torchao" else ""
            raise _refusal(source, f"{path} has a quantization_config ({method}{what})")


def refuse_quantized_tensors(source: Source, headers: Mapping[str, Header]) -> None:
    """SourceError when a safetensors header of the plan shows quantized tensors."""
    for name, (metadata, entries) in sorted(headers.items()):
        found = _quantized_tensor(metadata, entries)
        if found:
            raise _refusal(source, f"{name} holds {found}")


def _quantized_tensor(metadata: Mapping[str, str], entries: Mapping[str, Any]) -> str | None:
    for key, value in metadata.items():
        if key == "tensor_names" or not isinstance(value, str) or '"_type"' not in value:
            continue
        try:
            kind = json.loads(value).get("_type")
        except (ValueError, AttributeError):
            continue
        if kind not in (None, "Tensor"):
            return f"torchao tensors ({key} is a {kind})"
    for key, entry in sorted(entries.items()):
        if key.endswith(QUANTIZED_SUFFIXES) or "._weight_qdata" in key:
            return f"quantized weight parts ({key})"
        if key.endswith(".weight") and entry.dtype in QUANTIZED_DTYPES:
            return f"quantized weights ({key} is {entry.dtype})"
    return None


def _torchao_type(declared: dict[str, Any]) -> str:
    quant_type = declared.get("quant_type")
    default = quant_type.get("default") if isinstance(quant_type, dict) else None
    kind = default.get("_type") if isinstance(default, dict) else None
    return f": {kind}" if isinstance(kind, str) else ""


def _refusal(source: Source, why: str) -> SourceError:
    base = source.card_data.get("base_model")
    if isinstance(base, list) and len(base) == 1:
        base = base[0]
    hint = f" (its card names base_model: {base})" if isinstance(base, str) and base else ""
    return SourceError(f"{source.display} is already quantized: {why}; hf-ao-publish quantizes an unquantized model, "
                       f"so publish from the unquantized base it was made from{hint}")
