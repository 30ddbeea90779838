"""What a component's files hold, tensor by tensor, in torchao's own serialized form.

For safetensors this is read from the headers alone: torchao's ``flatten_tensor_state_dict`` writes every tensor
subclass as its inner tensors (``<module>._<param>_<part>``, each with its dtype and shape) plus a JSON entry in the
header metadata (``_type``: the class, ``_data``: its attributes, such as ``block_size`` or ``act_quant_kwargs``).
A pickle ``.bin`` is loaded with ``torch.load(weights_only=True)`` only (after ``import torchao``, which allows its
tensor classes) and passed through the same ``flatten_tensor_state_dict``, so both formats are described alike.
A pickle that torch's weights-only loader refuses is not unpickled any other way: what it holds is reported as not
checked. ``scan_values`` then reads every stored float tensor once for non-finite values.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publisher.loadpath import NotApplicable, read_pickled
from publisher.streaming.safetensors_io import read_header
from publisher.verify.target_layout import PICKLE

log = logging.getLogger(__name__)

# safetensors header dtypes -> torch's names (what torchao's own attributes and messages use)
DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
          "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64", "I64": "int64",
          "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}
PLAIN = "Tensor"


@dataclass
class Stored:
    """One tensor of the state dict as stored: a plain tensor, or a torchao tensor subclass and its parts."""

    name: str  # the state-dict name: model.layers.0.self_attn.q_proj.weight
    kind: str  # "Tensor", or the torchao class (Int8Tensor)
    data: dict[str, Any]  # torchao's serialized attributes (empty for a plain tensor)
    parts: dict[str, tuple[str, tuple[int, ...]]]  # inner tensor -> (dtype, shape); a plain tensor's is ""

    @property
    def quantized(self) -> bool:
        return self.kind != PLAIN

    @property
    def dtype(self) -> str:
        """The high-precision dtype: the one a torchao tensor records, or a plain tensor's own."""
        recorded = self.data.get("dtype")
        if isinstance(recorded, dict) and isinstance(recorded.get("_data"), str):
            return recorded["_data"]
        return self.parts[""][0] if "" in self.parts else "bfloat16"

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: a plain tensor's, or (for the torchao classes we read) their qdata's."""
        return (self.parts.get("") or self.parts.get("qdata") or ("", ()))[1]


@dataclass
class StoredSet:
    tensors: dict[str, Stored] = field(default_factory=dict)
    not_checked: list[str] = field(default_factory=list)  # what could not be read (pickles torch refuses), and why
    flat: dict[str, Any] | None = field(default=None, repr=False)  # a pickle's flattened tensors, for scan_values


def describe_files(folder: Path, fmt: str | None) -> StoredSet:
    """Every tensor of the component in ``folder`` (safetensors: headers only; pickle: weights_only=True)."""
    if fmt == PICKLE:
        return _from_pickle(folder)

    metadata: dict[str, str] = {}
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    names: list[str] = []
    for shard in sorted(folder.glob("*.safetensors")):
        meta, header = read_header(shard)
        meta = dict(meta)
        names += json.loads(meta.pop("tensor_names", "[]") or "[]")
        metadata.update(meta)
        entries.update({k: (DTYPES.get(e.dtype, e.dtype), tuple(e.shape)) for k, e in header.items()})
    return StoredSet(_parse(metadata, entries, names))


def _parse(metadata: dict[str, str], entries: dict[str, tuple[str, tuple[int, ...]]], names: list[str]) -> dict[str, Stored]:
    out: dict[str, Stored] = {}
    claimed: set[str] = set()
    for name in dict.fromkeys(names):
        try:
            meta = json.loads(metadata.get(name, "null")) or {}
        except ValueError:
            meta = {}
        kind = meta.get("_type") if isinstance(meta, dict) else None
        if kind in (None, PLAIN) or "." not in name:
            continue
        module, param = name.rsplit(".", 1)
        prefix = f"{module}._{param}_"
        wanted = meta.get("_tensor_data_names") or []
        parts = {k[len(prefix):]: v for k, v in entries.items() if k.startswith(prefix) and k[len(prefix):] in wanted}
        claimed |= {prefix + p for p in parts}
        out[name] = Stored(name, str(kind), dict(meta.get("_data") or {}), parts)
    for key, entry in entries.items():
        if key not in claimed and key not in out:
            out[key] = Stored(key, PLAIN, {}, {"": entry})
    return out


def _from_pickle(folder: Path) -> StoredSet:
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict


    try:  # torch.load(weights_only=True) only, as the manual path and the library loaders read it
        state = read_pickled(folder)
    except NotApplicable as exc:
        return StoredSet(not_checked=[f"{exc}, so its tensors were not checked"])
    try:
        flat, metadata = flatten_tensor_state_dict(state)
    except (ValueError, TypeError, NotImplementedError) as exc:  # a tensor class torchao cannot flatten
        return StoredSet(not_checked=[f"the pickle's tensors cannot be described by torchao ({exc})"])
    return StoredSet(parse_flat(flat, metadata), flat=flat)


def parse_flat(flat: dict[str, Any], metadata: dict[str, str]) -> dict[str, Stored]:
    """The tensors of a state dict flattened by torchao's ``flatten_tensor_state_dict`` (tensors, metadata)."""
    entries = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in flat.items()}
    return _parse(metadata, entries, json.loads(metadata.get("tensor_names", "[]")))


def scan_values(folder: Path, stored: StoredSet) -> tuple[list[str], list[str]]:
    """(problems, notes) from the stored values: a non-finite value in any stored float tensor is a problem naming
    the layer and part; a torchao weight whose scales are all 0 (its weights dequantize to 0) is a note."""
    import torch

    owner = {f"{s.name.rsplit('.', 1)[0]}._{s.name.rsplit('.', 1)[1]}_{p}": (s.name, p)
             for s in stored.tensors.values() if s.quantized for p in s.parts}
    problems: list[str] = []
    notes: list[str] = []

    def look(key: str, t: Any) -> None:
        if not (t.is_floating_point() and t.numel()):
            return
        name, part = owner.get(key, (key, ""))
        if t.element_size() == 1:  # float8: isfinite and any are not implemented for it
            t = t.float()
        finite = torch.isfinite(t)
        if not bool(finite.all()) and len(problems) < 3:
            what = "NaN" if bool(torch.isnan(t).any()) else "inf"
            where = f"the stored {part} of {name}" if part else f"the stored tensor {name}"
            problems.append(f"{where} holds {what} ({int((~finite).sum())} of {t.numel()} values): the layer "
                            f"{name.rsplit('.', 1)[0]} computes non-finite outputs")
        elif part == "scale" and not bool(t.any()):
            notes.append(f"every stored scale of {name} is 0: the layer's weights dequantize to 0")

    if stored.flat is not None:
        for key, t in stored.flat.items():
            look(key, t)
        return problems, notes
    from safetensors import safe_open

    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  # safe_open is not a mapping
                look(key, f.get_tensor(key))
    return problems, notes
