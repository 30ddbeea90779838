"""What a publish is asked (PublishRequest, from the CLI's options) and what it answers for each recipe (Outcome:
the --json result and the summary line)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from publisher.errors import TargetError
from publisher.handoffs.report import Mode, VerifyReport
from publisher.quality import stage as quality
from publisher.runtime.heap import peak_rss
from publisher.stages import planning

if TYPE_CHECKING:  # types only
    from publisher.quality.grid import GridFigures
    from publisher.quality.lm import LmFigures

Engine = Literal["auto", "streaming", "library"]


@dataclass
class PublishRequest:
    model: str
    quant: list[str]
    components: list[str] | None = None
    exclude: list[str] = field(default_factory=list)
    layer_config: list[str] = field(default_factory=list)  # --layer-config [COMPONENT=]FILE|JSON values
    repo_id: str | None = None
    revision: str | None = None
    private: bool = False
    token: str | None = field(default=None, repr=False)
    output_dir: Path | None = None
    push: bool = True
    create_pr: bool = False
    trust_remote_code: bool = False
    keep_going: bool = False
    verify_envs: tuple[str, ...] = ()  # interpreters or version specs: must pass, like this environment
    compat: tuple[str, ...] = ()  # the card's compatibility matrix: "default" (also when empty), "none", or specs
    sample_prompt: str | None = None
    sample_steps: int = 28
    sample_size: int = 1024
    engine: Engine = "auto"
    low_disk: bool | None = None  # None: auto (only when the download would not fit)
    verify_mode: Mode = "auto"
    benchmark: bool = False  # measure latency/memory vs bf16 also on a CPU (always on a GPU)
    allow_unquantized: bool = False  # publish a component in which no layer could be quantized
    max_shard_size: str | None = None  # output shard size; None: the library's, or lowdisk_push.LOW_DISK_SHARD with --low-disk
    recheck_published: bool = False  # after the push, also read the commit back and reload it (hashes are always checked)
    force: bool = False  # publish even when the target's state says it is up to date
    command: str = "hf-ao-publish"
    evaluation: quality.Settings | None = None  # perplexity / grid / --min-quality (publisher/quality); None: none

    def card_options(self, kind: str) -> dict[str, Any]:
        """The options that change only the card (its snippet, measurements and tables), for the plan's kind: a
        re-run that changes one of them is not up to date. Steps and size are a pipeline snippet's only."""
        options: dict[str, Any] = {"sample_prompt": self.sample_prompt, "benchmark": self.benchmark,
                                   "compat": list(self.compat or ("default",)), "verify_envs": list(self.verify_envs),
                                   "evaluation": self.evaluation.to_dict() if self.evaluation else None}
        if kind == "pipeline":
            options.update(sample_steps=self.sample_steps, sample_size=self.sample_size)
        return options


@dataclass
class Outcome:
    """What happened to one recipe: the --json result and the summary line come from this."""

    recipe: str
    repo_id: str | None  # None: no repo id was chosen (--no-push without a token or --repo-id)
    folder: Path | None = None
    url: str | None = None
    commit: str | None = None
    pr_url: str | None = None
    verified: bool = False
    up_to_date: bool = False
    pushed: bool = False
    error: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    components: list[dict[str, Any]] = field(default_factory=list)
    report: VerifyReport | None = None
    published_check: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # stage wall times
    rss_after: dict[str, int] = field(default_factory=dict)  # this process's peak RSS at the end of each stage
    benchmark: dict[str, Any] | None = None  # stages.measure result
    quality: LmFigures | GridFigures | None = None  # quality.stage figures (perplexity and continuation, or the grid)
    copied: list[dict[str, Any]] = field(default_factory=list)  # --low-disk push: files copied Hub to Hub

    def target(self) -> str:  # the repo id a push writes to (a push always has one: it needs a token)
        if self.repo_id is None:
            raise TargetError(f"{self.recipe}: {planning.NO_TARGET}")
        return self.repo_id

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "repo_id_note": None if self.repo_id else planning.NO_TARGET,
            "url": self.url,
            "commit": self.commit,
            "pr_url": self.pr_url,
            "recipe": self.recipe,
            "components": self.components,
            "files": [{"name": k, "size": v} for k, v in sorted(self.files.items())],
            "verified": self.verified,
            "pushed": self.pushed,
            "up_to_date": self.up_to_date,
            "folder": str(self.folder) if self.folder else None,
            "card_path": str(self.folder / "README.md") if self.folder else None,
            "verification": self.report.to_dict() if self.report else None,
            "published_check": self.published_check,
            "quality": [asdict(q) for q in self.report.quality] if self.report else [],
            "evaluation": quality.to_json(self.quality),
            "seconds": self.seconds,
            "peak_rss_after_stage": self.rss_after,
            "benchmark": self.benchmark,
            "copied_from_base": self.copied,
            "peak_rss_bytes": peak_rss(),
            "error": self.error,
        }
