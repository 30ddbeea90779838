"""What quantization covered, per component: how many layers were quantized and what was left alone, and why.

torchao's Linear configs convert ``nn.Linear`` weights only, so a model whose matmuls live elsewhere (GPT-2's
``Conv1D``, fused MoE experts stored as 3D parameters) can come out with few or no quantized layers. This module
counts what the model holds (built on the meta device from its config: no weight is read), says why each kind
was left alone, and refuses a component with no quantized layer unless the user accepts it
(``--allow-unquantized``). The card and ``--json`` show the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from publisher.errors import QuantizeError
from publisher.handoffs.artifacts import KeptKind, LayerReport
from publisher.loadpath import meta_model

_LABEL = {"library": "Linear kept by the library's rules", "exclude": "Linear kept with --exclude",
          "layer-config": "Linear kept by --layer-config", "skipped": "Linear skipped by torchao",
          "Conv1D": "Conv1D layers", "experts": "expert parameters", "Embedding": "embeddings", "conv": "convolutions",
          "norm": "norms", "other": "other parameters"}
# Why each kind was left alone. The three kinds of Linear kept on purpose say whose decision it was: the library's
# (transformers keeps output heads and tied embeddings), or the user's (--exclude, a null entry in --layer-config).
_WHY = {
    "library": "kept on purpose: the library's default rules (output heads, tied embeddings)",
    "exclude": "kept: --exclude names {them}",
    "layer-config": "kept: --layer-config maps {them} to null",
    "skipped": "torchao left them as they were (a shape the recipe does not support)",
    "Conv1D": "a Linear stored transposed (GPT-2 family); torchao's recipes quantize nn.Linear only",
    "experts": ("fused MoE expert weights (3D parameters, not nn.Linear). torchao 0.18 can quantize them through "
                "FqnToConfig, but the quantized experts do not run under transformers' default experts kernels "
                "(grouped_mm: transpose, batched_mm: bmm are not implemented for its tensors), so they stay bf16"),
    "Embedding": "lookup tables, not matmuls; the recipes do not apply",
    "conv": "convolutions, not nn.Linear; the recipes do not apply",
    "norm": "normalisation scales and shifts: small, kept in bf16",
    "other": "other parameters (biases of unquantized layers, scale and position tables); kept in bf16",
}


def _kind_of(module: Any, torch: Any) -> str:
    name = type(module).__name__
    if name == "Conv1D":
        return "Conv1D"
    if isinstance(module, torch.nn.Embedding):
        return "Embedding"
    if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose2d)):
        return "conv"
    if "Norm" in name:
        return "norm"
    return "other"


def layer_report(library: str, class_name: str, config_folder: Path, quantized: list[str], skipped: list[str],
                 excluded: list[str], kept_by: Mapping[str, str] | None = None) -> LayerReport:
    """The report of one component, from its base config (meta device) and what quantization recorded. ``kept_by``:
    the excluded layers the user kept ("exclude": --exclude, "layer-config": a null entry in --layer-config); the
    others were kept by the library's own rules."""
    import torch


    model = meta_model(library, class_name, _config(config_folder))
    kinds: dict[str, KeptKind] = {}

    def add(kind: str, name: str, nbytes: int) -> None:
        entry = kinds.setdefault(kind, KeptKind(kind, _LABEL[kind], 0, 0, _WHY[kind]))
        entry.count += 1
        entry.nbytes += nbytes
        if len(entry.examples) < 3:
            entry.examples.append(name)

    done_quantized, done_excluded, done_skipped = set(quantized), set(excluded), set(skipped)
    linear = total = 0
    seen: set[int] = set()  # a tied weight (lm_head = embed_tokens) is stored once: count it once
    for name, module in model.named_modules():
        own = {n: p for n, p in module.named_parameters(recurse=False) if id(p) not in seen}
        seen.update(id(p) for p in own.values())
        nbytes = sum(p.numel() * 2 for p in own.values())
        total += nbytes
        if isinstance(module, torch.nn.Linear):
            linear += 1
            if name in done_excluded:
                add((kept_by or {}).get(name, "library"), name, nbytes)
            elif name in done_skipped:
                add("skipped", name, nbytes)
            continue
        for pname, p in own.items():
            full = f"{name}.{pname}" if name else pname
            if p.dim() >= 3 and "expert" in full:
                add("experts", full, p.numel() * 2)
                nbytes -= p.numel() * 2
        if nbytes:
            add(_kind_of(module, torch), name or type(module).__name__, nbytes)
    for entry in kinds.values():
        entry.why = entry.why.format(them="it" if entry.count == 1 else "them")
    order = ["Conv1D", "experts", "Embedding", "library", "exclude", "layer-config", "skipped", "conv", "norm", "other"]
    return LayerReport(len(done_quantized), linear, sorted(kinds.values(), key=lambda k: order.index(k.kind)), total)


def _config(folder: Path) -> Any:
    import json

    data = json.loads((folder / "config.json").read_text())
    data.pop("quantization_config", None)  # the structure only
    return data


def require_quantized(label: str, class_name: str, recipe: str, report: LayerReport, allow: bool) -> str | None:
    """QuantizeError when nothing was quantized, naming what the component holds and what to do; with ``allow``
    the note the card carries instead (None when something was quantized)."""
    if report.quantized:
        return None
    found = ", ".join(f"{k.count} {k.label}" for k in report.kept if k.kind not in ("norm", "other")) or "no weight layers"
    if allow:
        return (f"{label} ({class_name}) has no layer quantized with {recipe} ({found}); it was published as it was, "
                "at the user's request (--allow-unquantized)")
    raise QuantizeError(
        f"{label} ({class_name}): no layer was quantized with {recipe}; it holds {report.linear} nn.Linear layers "
        f"and {found}, and torchao's recipes quantize nn.Linear weights only. Choose components that have Linear "
        "layers (--components), or pass --allow-unquantized to publish it unquantized; nothing was pushed")
