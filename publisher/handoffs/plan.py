"""The plan hand-off: the base, pinned (Source), and the whole job validated (Plan, its Components).

Made by stages/source.py and stages/planning.py, read by every later stage and by verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from publisher.io.integrity import FileHash
from publisher.recipes import Recipe

DENOISERS = ("transformer", "unet", "prior", "decoder")
# What AutoTokenizer reads a vocabulary from (tokenizer_config.json alone names a class, not a vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tiktoken.model", "tokenizer.tiktoken")


@dataclass(frozen=True)
class Source:
    """The base model, pinned."""

    model_id: str  # as the user gave it
    repo_id: str | None  # Hub repo id, None for a local folder
    local_dir: Path | None  # set for a local folder
    revision: str | None  # as the user gave it
    sha: str | None  # resolved commit sha (Hub only)
    sizes: dict[str, int] = field(default_factory=dict)  # every file of the base -> size in bytes
    card_data: dict[str, Any] = field(default_factory=dict)  # YAML front matter of the base README
    endpoint: str | None = None
    # Hub only: every file's sha256 (LFS) or git blob id as the Hub reports it at the pinned sha; every download
    # and range read of the base is compared with it before use (publisher.io.integrity)
    hashes: dict[str, FileHash] = field(default_factory=dict)
    gated: bool = False  # Hub only: its files need accepted terms (and, for a fine-grained token, gated read access)

    @property
    def files(self) -> list[str]:
        return sorted(self.sizes)

    @property
    def name(self) -> str:
        """How everything published names the base (card, state file, configs): the Hub repo id, or a local folder's
        own name (``my-pipeline``), never its path, which says where it sat on this machine (a home folder, a user
        name) and nothing about the model."""
        if self.repo_id:
            return self.repo_id
        return self.local_dir.name if self.local_dir is not None else Path(self.model_id).name

    @property
    def has_tokenizer(self) -> bool:
        """A tokenizer at the root (a transformers model's), which the card's snippets and the evaluation need."""
        return any(f in self.sizes for f in TOKENIZER_FILES)

    @property
    def display(self) -> str:
        if self.repo_id:
            return f"{self.repo_id}@{self.sha}"
        return str(self.local_dir)

    def url(self) -> str | None:
        if not self.repo_id:
            return None
        from huggingface_hub import constants

        return f"{(self.endpoint or constants.ENDPOINT).rstrip('/')}/{self.repo_id}"

    def where(self, path: str) -> str:
        """How errors name a file of the base: repo@sha/path, or the local path."""
        if self.local_dir is not None:
            return str(self.local_dir / path)
        return f"{self.repo_id}@{(self.sha or '')[:12]}/{path}"


@dataclass(frozen=True)
class Component:
    """One model of the base: a pipeline component, or the whole transformers model (name "")."""

    name: str
    library: str  # "diffusers" | "transformers"
    class_name: str
    quantize: bool
    linear_names: tuple[str, ...] = ()  # every nn.Linear, from the meta-device build
    module_names: frozenset[str] = frozenset()
    param_bytes: int = 0  # parameters at the load dtype (bf16)
    weight_files: tuple[str, ...] = ()  # the base files that hold its weights
    linear_shapes: tuple[tuple[str, int, int], ...] = ()  # (Linear, out_features, in_features), from the meta build
    param_names: tuple[str, ...] = ()  # every parameter fqn (per-layer entries are matched against them)
    default_skips: tuple[str, ...] = ()  # modules the library keeps unquantized by default (transformers: lm_head...)

    @property
    def subfolder(self) -> str | None:
        return self.name or None

    @property
    def label(self) -> str:
        return self.name or "model"

    def path(self, root: Path) -> Path:
        return root / self.name if self.name else root


@dataclass(frozen=True)
class Plan:
    source: Source
    kind: str  # "pipeline" | "transformers"
    pipeline_class: str | None
    components: tuple[Component, ...]
    recipes: tuple[Recipe, ...]
    exclude: tuple[str, ...]
    targets: dict[str, str | None]  # recipe name -> target repo id (None: none chosen, --no-push without a token)
    base_files: tuple[str, ...]  # what the snapshot stage downloads
    library_name: str
    pipeline_tag: str | None
    trust_remote_code: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # the user's options, for the card and fingerprint

    @property
    def quantized(self) -> list[Component]:
        return [c for c in self.components if c.quantize]

    @property
    def kept(self) -> list[Component]:
        return [c for c in self.components if not c.quantize]

    @property
    def base_hashes(self) -> dict[str, FileHash]:
        """The Hub's sha256 / git blob id of every base file the run reads (empty for a local folder): each download
        and each range-read shard is compared with it before use, and the state file records it."""
        return {f: self.source.hashes[f] for f in self.base_files if f in self.source.hashes}
