"""What a publish is asked (PublishRequest, from the CLI's options) and what it answers for each recipe (Outcome:
the --json result and the summary line)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from publisher.errors import UsageError
from publisher.handoffs.report import Mode, VerifyReport
from publisher.quality import stage as quality
from publisher.runtime.heap import peak_rss

if TYPE_CHECKING:  # types only
    from publisher.quality.grid import GridFigures
    from publisher.quality.lm import LmFigures

Engine = Literal["auto", "streaming", "library"]
# Outcome's note, and the refusal of a push that has no target (job.py)
NO_TARGET = ("no repo id was chosen: there is no --repo-id, and the Hub was not asked whose the default "
             "<user>/<base>-torchao-<recipe> would be (no token, or HF_HUB_OFFLINE set); pass --repo-id NAMESPACE/NAME, "
             "or set HF_TOKEN and reach the Hub")


def size_bytes(value: str | int) -> int:
    """A size as save_pretrained takes it ("2GB", "500MB", "10KB": decimal units; or a number of bytes), in bytes."""
    text = str(value).strip().upper()
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    number, unit = (text[:-2], units[text[-2:]]) if text[-2:] in units else (text, 1)
    try:
        size = int(float(number) * unit)
    except ValueError:
        raise ValueError(f"{value!r} is not a size") from None
    if size <= 0:
        raise ValueError(f"{value!r} is not a positive size")
    return size


def low_disk_conflict(*, benchmark: bool, verify_envs: bool, push: bool) -> str | None:
    """What cannot run when the base's weights are read by HTTP range and each output shard is uploaded and deleted as
    it is made: the one rule, which the request says for --low-disk (a usage error) and the preflight when it chooses
    low-disk because the download would not fit (a failure). None when nothing conflicts."""
    if benchmark:
        return "--benchmark runs the whole bf16 base, which --low-disk does not download"
    if verify_envs and push:
        return ("with --low-disk a push uploads and deletes each shard as it is made, so --verify-env has nothing to "
                "reload")
    return None


@dataclass(frozen=True)
class BaseSpec:
    """What to read: the base (a Hub id or a local folder), at which revision, and which of its components."""

    model: str
    revision: str | None = None
    components: list[str] | None = None  # None: what --quant maps, else every quantizable component
    exclude: list[str] = field(default_factory=list)
    trust_remote_code: bool = False


@dataclass(frozen=True)
class MakeSpec:
    """What to make: the recipes (--quant values, --layer-config tables) and how the weights are written."""

    quant: list[str]
    layer_config: list[str] = field(default_factory=list)  # --layer-config [COMPONENT=]FILE|JSON values
    engine: Engine = "auto"
    max_shard_size: str | None = None  # None: the library's, or lowdisk_push.LOW_DISK_SHARD with --low-disk
    allow_unquantized: bool = False  # publish a component in which no layer could be quantized

    def __post_init__(self) -> None:
        if self.max_shard_size is not None:
            try:
                size_bytes(self.max_shard_size)
            except ValueError:
                raise UsageError(f"--max-shard-size {self.max_shard_size!r} is not a size; give one such as 2GB, "
                                 "500MB or 1000000000") from None


@dataclass(frozen=True)
class TargetSpec:
    """Where it goes: the target repo and how it is written, or only a local folder (push=False)."""

    repo_id: str | None = None  # may hold {recipe}
    push: bool = True
    private: bool = False
    create_pr: bool = False
    force: bool = False  # publish even when the target's state says it is up to date
    output_dir: Path | None = None  # None: a temporary folder (removed after a push)
    low_disk: bool | None = None  # None: auto (only when the download would not fit)
    recheck_published: bool = False  # after the push, also read the commit back and reload it


@dataclass(frozen=True)
class CheckSpec:
    """What to verify and measure: the gating environments, the compatibility matrix, the card's sample and the
    measurements (benchmark, quality evaluation)."""

    verify_envs: tuple[str, ...] = ()  # interpreters or version specs: must pass, like this environment
    compat: tuple[str, ...] = ()  # the card's compatibility matrix: "default" (also when empty), "none", or specs
    verify_mode: Mode = "auto"  # auto becomes full with --verify-env (whole reloads in the other interpreters)
    benchmark: bool = False  # measure latency/memory vs bf16 also on a CPU (always on a GPU)
    sample_prompt: str | None = None
    sample_steps: int = 28
    sample_size: int = 1024
    evaluation: quality.Settings | None = None  # perplexity / grid / --min-quality (publisher/quality); None: none

    def __post_init__(self) -> None:
        if self.verify_envs and self.verify_mode == "streaming":
            raise UsageError("--verify-env reloads whole components in another interpreter; use --verify-mode full or "
                             "auto with it")
        if self.verify_mode == "streaming" and set(self.compat) - {"default", "none"}:
            raise UsageError("--compat environments reload whole components in another interpreter; use --verify-mode "
                             "full or auto with them")
        if self.verify_envs and self.verify_mode == "auto":
            object.__setattr__(self, "verify_mode", "full")

    @property
    def sample(self) -> dict[str, Any]:
        return {"prompt": self.sample_prompt, "steps": self.sample_steps, "size": self.sample_size}


@dataclass(frozen=True)
class PublishRequest:
    """A publish as data: four groups (read, make, target, checks), the token, and how the run behaves. Every usage
    rule is checked here, where it is built (UsageError: exit 2), so the CLI only parses into it."""

    base: BaseSpec
    make: MakeSpec
    target: TargetSpec = field(default_factory=TargetSpec)
    checks: CheckSpec = field(default_factory=CheckSpec)
    token: str | None = field(default=None, repr=False)
    keep_going: bool = False
    command: str = "hf-ao-publish"  # the card's command line (never a secret)

    def __post_init__(self) -> None:
        if self.target.low_disk:
            conflict = low_disk_conflict(benchmark=self.checks.benchmark, verify_envs=bool(self.checks.verify_envs),
                                         push=self.target.push)
            if conflict:
                fix = ", or add --no-push" if "--verify-env" in conflict else ""
                raise UsageError(f"{conflict}; drop one of them{fix}")
            if self.make.engine == "library":
                raise UsageError("--low-disk reads weights by HTTP range, which only the streaming engine does; drop "
                                 "--engine library")

    def card_options(self, kind: str) -> dict[str, Any]:
        """The options that change only the card (its snippet, measurements and tables), for the plan's kind: a
        re-run that changes one of them is not up to date. Steps and size are a pipeline snippet's only."""
        checks = self.checks
        options: dict[str, Any] = {"sample_prompt": checks.sample_prompt, "benchmark": checks.benchmark,
                                   "compat": list(checks.compat or ("default",)), "verify_envs": list(checks.verify_envs),
                                   "evaluation": checks.evaluation.to_dict() if checks.evaluation else None}
        if kind == "pipeline":
            options.update(sample_steps=checks.sample_steps, sample_size=checks.sample_size)
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

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "repo_id_note": None if self.repo_id else NO_TARGET,
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
