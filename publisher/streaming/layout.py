"""Planning: every output name, dtype, shape, torchao metadata string, shard and byte offset, before any weight is read.

Quantized weights' flattened layout (``_weight_qdata``, ``_weight_scale``...) and metadata JSON come
from running the library's own quantize call on a *meta* tensor of the same shape (on the GPU
for CUDA recipes, where a handler may choose its layout by device), once per distinct shape. The
engine re-checks every real tensor against this plan, so a data-dependent layout would stop the
run with an error instead of writing a wrong file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from publisher.streaming import safetensors_io as stio

if TYPE_CHECKING:
    import torch

    from publisher.adapters import LibraryAdapter


@dataclass
class OutTensor:
    """One tensor of an output safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: str = ""
    offset: int = 0  # absolute offset in the output file


@dataclass
class Work:
    """One checkpoint tensor and what becomes of it."""

    key: str
    src_file: str
    kind: str  # "quantize" | "pass" | "skip" (a Linear torchao leaves as is, written in bf16)
    dtype: torch.dtype  # saved dtype for pass/skip; the cast before quantizing for quantize
    shape: tuple[int, ...]
    outputs: list[OutTensor]  # empty for keys the library does not save (tied weights)
    metadata: str  # the torchao metadata JSON planned for this key


@dataclass
class OutFile:
    name: str
    header: bytes
    entries: list[OutTensor]
    size: int


@dataclass
class Layout:
    """Where every saved tensor of one component goes (files, offsets, classes), planned on the meta device."""

    component: LibraryAdapter
    device: str
    work: list[Work]  # grouped by input file, then by position in that file once known
    input_files: list[str]  # in processing order
    files: list[OutFile]
    index: str | None  # the index JSON text when sharded
    quantized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)
    classes: dict[str, str] = field(default_factory=dict)  # quantized module -> the torchao class of its weight


def _probe(comp: LibraryAdapter, key: str, device: str, cache: dict[tuple, tuple]) -> tuple[str | None, list, str]:
    """(tensor class or None if torchao left it, [(suffix, dtype, shape)], metadata) for a quantized key.

    ``device`` is "meta" (no data at all) or the real quantize device; one probe per distinct shape.
    """
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    shape = tuple(comp.meta[key].shape)
    mod = comp.module_of(key)
    # the config this key gets: one per component, or its FqnToConfig entry (same shape, other config: other layout)
    sig = (shape, type(mod).__name__, getattr(mod, "bias", None) is not None, key.rpartition(".")[2], comp.config_key(key))
    if sig in cache:
        return cache[sig]
    try:
        weight = _quantize_probe(comp, key, shape, device)
        flat, meta = flatten_tensor_state_dict({key: weight.detach()})
    finally:
        comp.detach_weight(key)
    cls = meta[key] and json.loads(meta[key]).get("_type")
    parts = [(name[len(key.rpartition(".")[0]) + 1:], t.dtype, tuple(t.shape)) for name, t in flat.items()]
    result = (None if cls == "Tensor" else cls, parts, meta[key])
    cache[sig] = result
    return result


def _quantize_probe(comp: LibraryAdapter, key: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """The library's quantize call on a stand-in of ``key``: on the meta device (no data) when ``device`` is "meta",
    with random values on the CPU when the config's algorithm reads values (HQQ's ``.item()``)."""
    import torch

    if device != "meta":
        value = torch.randn(shape, dtype=comp.cast_dtype, device=device)  # ordinary data: no 0/0 scales
        return comp.quantize_param(key, value, torch.device(device))
    try:
        return comp.quantize_param(key, torch.empty(shape, dtype=comp.cast_dtype, device="meta"), "meta")
    except (RuntimeError, NotImplementedError):  # a data-dependent algorithm: the values of a stand-in are enough
        comp.detach_weight(key)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            value = torch.randn(shape, dtype=comp.cast_dtype)
        return comp.quantize_param(key, value, torch.device("cpu"))


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    import math

    import torch

    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def build_layout(comp: LibraryAdapter, key_files: dict[str, str], device: str, probe_device: str,
               expected_classes: set[str] | None, max_shard_size: int | str | None) -> Layout:
    """Lay out the output exactly as ``save_pretrained`` would, from the meta model and the checkpoint index.
    ``expected_classes``: the torchao classes the component's configs make (a planned tensor of another class stops
    the run)."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    missing = [k for k in comp.names if k not in key_files and k not in comp.dropped_on_save]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} parameters of the model, e.g. {missing[0]!r}")

    cache: dict[tuple, tuple] = {}
    work: list[Work] = []
    flat: dict[str, OutTensor] = {}  # the flattened state dict save_pretrained shards, in its order
    qmeta: dict[str, str] = {}
    quantized, skipped, excluded = [], [], []
    classes: dict[str, str] = {}
    plain_meta = json.dumps({"_type": "Tensor"})
    for key in comp.names:
        shape = tuple(comp.meta[key].shape)
        module = key.rpartition(".")[0]
        # A key the checkpoint lacks (a tied weight) never reaches the quantizer: it is tied afterwards.
        if key in comp.quantize_keys and key in key_files:
            cls, parts, meta = _probe(comp, key, probe_device, cache)
            if cls is None:
                if key.endswith(".weight"):  # a parameter the library offers its op (a guarded bias) is no layer
                    skipped.append(module)
                kind, dtype = "skip", comp.cast_dtype
                outs = [OutTensor(key, dtype, shape, _nbytes(dtype, shape))]
            else:
                if expected_classes and cls not in expected_classes:
                    raise ValueError(f"torchao produced {cls} for {key}, the recipe expects "
                                     f"{' or '.join(sorted(expected_classes))}")
                if key.endswith(".weight"):
                    quantized.append(module)
                    classes[module] = cls
                kind, dtype = "quantize", comp.cast_dtype
                outs = [OutTensor(f"{module}.{suffix}", d, s, _nbytes(d, s)) for suffix, d, s in parts]
        else:
            if key in comp.linear_weights:
                excluded.append(module)
            kind, dtype, meta = "pass", comp.pass_dtype(key, comp.meta[key].dtype), plain_meta
            outs = [OutTensor(key, dtype, shape, _nbytes(dtype, shape))]
        qmeta[key] = meta
        if key in comp.dropped_on_save:
            outs = []
        for o in outs:
            flat[o.name] = o
        if key in key_files:
            work.append(Work(key, key_files[key], kind, dtype, shape, outs, meta))
    qmeta["tensor_names"] = json.dumps(comp.names)

    pattern = comp.weights_name.replace(".safetensors", "{suffix}.safetensors")
    flat = {name: flat[name] for name in comp.save_order(list(flat))}
    split = split_state_dict_into_shards_factory(
        flat, get_storage_size=lambda o: o.nbytes, filename_pattern=pattern,
        max_shard_size=max_shard_size if max_shard_size is not None else comp.max_shard_size,
    )
    header_md = comp.header_metadata(qmeta)
    files = [_lay_out(name, [flat[n] for n in names], header_md) for name, names in split.filename_to_tensors.items()]
    index = None
    if split.is_sharded:
        index_obj = {"metadata": comp.index_metadata(split.metadata["total_size"], qmeta),
                     "weight_map": split.tensor_to_filename}
        index = json.dumps(index_obj, indent=2, sort_keys=True) + "\n"

    # Consume input shards in name order (shard 1 first: the output order follows it best).
    input_files = sorted({w.src_file for w in work})
    work.sort(key=lambda w: input_files.index(w.src_file))
    return Layout(comp, device, work, input_files, files, index, quantized, skipped, excluded, classes)


def _lay_out(name: str, entries: list[OutTensor], metadata: dict[str, str]) -> OutFile:
    order = stio.order_entries([(e.name, e.dtype) for e in entries])
    ordered = [entries[i] for i in order]
    rel, spans = 0, []
    for e in ordered:
        spans.append((e.name, stio.dtype_name(e.dtype), e.shape, rel, rel + e.nbytes))
        rel += e.nbytes
    header = stio.encode_header(metadata, spans)
    for e, (_, _, _, begin, _) in zip(ordered, spans):
        e.file, e.offset = name, len(header) + begin
    return OutFile(name, header, ordered, len(header) + rel)
