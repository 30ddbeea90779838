"""The quantized-artifacts hand-off: what the quantize stage made (a repo folder, per-component summaries, the
in-memory models) and what coverage found, for verification, the card and the push.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from publisher.handoffs.report import PassForward
from publisher.recipes import Recipe

MARKER = ".hf-ao-publish-partial.json"  # marks an unfinished repo folder as ours (stages/unfinished.py); never published


class UploadedShards(Protocol):
    """Shards already checked, uploaded and deleted from the folder (the --low-disk push's stages.lowdisk_push.ShardUploader);
    verification reads what was checked before each upload."""

    sizes: dict[str, int]  # path in repo -> bytes (the local file is gone)
    checked: dict[str, int]  # component -> tensors checked before upload
    classes: dict[str, int]  # component -> quantized layers of the expected class


@dataclass
class KeptKind:
    kind: str  # e.g. "Conv1D", "Embedding", "experts"
    label: str  # for people: "Conv1D layers", "expert parameters"
    count: int  # modules (or parameters, for experts)
    nbytes: int  # their weights in bf16
    why: str
    examples: list[str] = field(default_factory=list)


@dataclass
class LayerReport:
    quantized: int  # Linear layers whose weight became a torchao tensor
    linear: int  # every nn.Linear of the component
    kept: list[KeptKind]
    total_bytes: int  # every parameter, in bf16

    def kind(self, name: str) -> KeptKind | None:
        return next((k for k in self.kept if k.kind == name), None)

    def expert_share(self) -> float:
        """The fraction of the component's bf16 weights held by expert parameters (which stay bf16)."""
        experts = self.kind("experts")
        return experts.nbytes / self.total_bytes if experts and self.total_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class QuantizedComponent:
    name: str
    library: str
    class_name: str
    quantized: list[str]  # Linear layers whose weight is now a torchao tensor
    skipped: list[str]  # Linear layers meant to be quantized that torchao left as they were
    excluded: list[str]  # Linear layers kept on purpose (--exclude, library defaults, a null --layer-config entry)
    tensor_classes: dict[str, int]  # torchao tensor class -> count
    bytes_before: int  # bf16 weights
    bytes_after: int  # saved weight files
    quantization_config: dict[str, Any]  # as stored in config.json
    engine: str = "library"
    fp8_check: dict[str, Any] | None = None  # FP8 made on a CPU: dequantized weights vs the bf16 base
    peak_rss_bytes: int | None = None  # streaming engine: the process's peak RSS after this component
    stage_seconds: dict[str, float] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict, repr=False)  # streaming engine: in-memory tensor digests
    forward: PassForward | None = field(default=None, repr=False)  # streaming engine: forward passes during the pass
    eval_forward: PassForward | None = field(default=None, repr=False)  # the same, on the perplexity text (quality/)
    layer_classes: dict[str, str] = field(default_factory=dict, repr=False)  # quantized Linear -> its torchao class
    kept_by: dict[str, str] = field(default_factory=dict)  # excluded layers the user kept: "exclude" | "layer-config"

    @property
    def label(self) -> str:
        return self.name or "model"

    def to_json(self, layers: dict[str, Any]) -> dict[str, Any]:
        """The component in the run's --json output (``layers``: coverage.LayerReport.to_dict())."""
        return {
            "layers": layers,
            "name": self.label,
            "class": self.class_name,
            "quantized_layers": len(self.quantized),
            "skipped_layers": self.skipped,
            "excluded_layers": len(self.excluded),
            "tensor_classes": self.tensor_classes,
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "engine": self.engine,
            "stage_seconds": self.stage_seconds,
        }


@dataclass
class Artifacts:
    recipe: Recipe
    folder: Path
    components: list[QuantizedComponent]
    models: dict[str, Any] = field(default_factory=dict, repr=False)  # in-memory quantized models, for verify
    device: str = "cpu"  # where the weights were quantized
    uploader: UploadedShards | None = None  # shards already pre-uploaded and deleted (--low-disk push)
    layers: dict[str, LayerReport] = field(default_factory=dict)  # component name -> what was quantized, left alone, why
    notes: list[str] = field(default_factory=list)  # for the card (e.g. a component published unquantized on request)

    def files(self) -> dict[str, int]:
        """Every file of the repo: those on disk and those already uploaded."""
        local = {p.relative_to(self.folder).as_posix(): p.stat().st_size for p in self.folder.rglob("*")
                 if p.is_file() and p.name != MARKER}
        if self.uploader is not None:
            local.update(self.uploader.sizes)
        return dict(sorted(local.items()))

    def uploaded(self, component: str) -> int:
        """How many tensors of ``component`` were checked before its shards were uploaded and deleted (0: its
        shards are in the folder)."""
        return self.uploader.checked.get(component, 0) if self.uploader is not None else 0

    def uploaded_layers(self, component: str) -> int:
        """The quantized layers of the recipe's class among those checked before upload."""
        return self.uploader.classes.get(component, 0) if self.uploader is not None else 0

    def release_models(self) -> None:
        self.models.clear()
