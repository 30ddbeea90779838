"""Where a run's output goes, chosen once when the run is planned: a local folder (the default), or the target repo
itself, staged shard by shard (``--low-disk`` with a push, when the output would not fit on disk).

Every stage after the choice asks the target, never a mode flag: the quantize stage gets the recipe's uploader (None
for a folder), the verification its mode, the push its way of publishing. Reading the base by HTTP range
(``fetch.RemoteWeights``) is the input side of ``--low-disk`` and is chosen beside this, not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from publisher.stages import lowdisk_push
from publisher.stages import push as pushing

if TYPE_CHECKING:
    from publisher.handoffs.artifacts import Artifacts
    from publisher.handoffs.plan import Plan
    from publisher.handoffs.report import Mode, VerifyReport
    from publisher.recipes import Recipe
    from publisher.stages.hubcopy import HubCopy
    from publisher.stages.push import PushResult


class RecipeOutput(Protocol):
    """One recipe's way out: opened when its build starts, published or abandoned at the end."""

    @property
    def uploader(self) -> lowdisk_push.ShardUploader | None:
        """Shards leave as they are made (None: they stay in the folder)."""

    def finish(self) -> list[dict[str, Any]]:
        """After the build: the base files that went to the target another way (Hub to Hub)."""

    def abandon(self) -> None:
        """After a failure, or a run that stopped before this recipe's push: nothing half-made stays behind."""

    def publish(self, artifacts: Artifacts, report: VerifyReport, *, message: str, description: str,
                state: dict[str, Any], check: Callable[[str], list[Path]]) -> PushResult:
        """Push the built recipe; ``check(commit)`` runs what verification still needs the pushed commit for."""


class OutputTarget(Protocol):
    @property
    def shard_size(self) -> int | None:
        """Output shard size in bytes (None: the library's default)."""

    @property
    def elsewhere(self) -> frozenset[str]:
        """Unchanged base files that reach the target without touching the disk."""

    def open(self, recipe: Recipe, repo_id: str | None, root: Path) -> RecipeOutput:
        """The output of ``recipe`` (building under ``root``), for the target repo ``repo_id``."""

    def verify_mode(self, asked: Mode) -> Mode:
        """The verification mode this output allows (``asked``: --verify-mode)."""


@dataclass(frozen=True)
class PushOptions:
    """How a push writes: --private, --create-pr, --force."""

    private: bool = False
    create_pr: bool = False
    force: bool = False


@dataclass
class _FolderOutput:
    repo_id: str | None
    token: str | None
    spec: PushOptions
    uploader: None = None

    def finish(self) -> list[dict[str, Any]]:
        return []

    def abandon(self) -> None:
        return None

    def publish(self, artifacts: Artifacts, report: VerifyReport, *, message: str, description: str,
                state: dict[str, Any], check: Callable[[str], list[Path]]) -> PushResult:
        if self.repo_id is None:
            raise RuntimeError("a push without a target repo")  # planning names every target of a push: a bug
        return pushing.push(artifacts.folder, report, repo_id=self.repo_id, token=self.token, private=self.spec.private,
                            create_pr=self.spec.create_pr, message=message, description=description, state=state,
                            force=self.spec.force)


@dataclass
class _StagedOutput:
    uploader: lowdisk_push.ShardUploader
    created: bool  # the target was created by this run and not yet handed to a push
    token: str | None
    create_pr: bool

    def finish(self) -> list[dict[str, Any]]:
        return self.uploader.finish_copy()

    def abandon(self) -> None:
        self.uploader.close()
        if self.created:  # once: not after the push took it over
            self.created = False
            lowdisk_push.discard(self.uploader.repo_id, self.token, True)

    def publish(self, artifacts: Artifacts, report: VerifyReport, *, message: str, description: str,
                state: dict[str, Any], check: Callable[[str], list[Path]]) -> PushResult:
        created, self.created = self.created, False  # the push deletes a repo it was given, if it fails
        return lowdisk_push.push_staged(artifacts.folder, report, self.uploader, token=self.token,
                                        create_pr=self.create_pr, message=message, description=description,
                                        created=created, check=check)


@dataclass(frozen=True)
class LocalFolder:
    """Today's default: every recipe's repo is built whole in a folder, then pushed (or kept, with --no-push)."""

    spec: PushOptions
    token: str | None
    shard_size: int | None = None
    elsewhere: frozenset[str] = field(default_factory=frozenset)

    def open(self, recipe: Recipe, repo_id: str | None, root: Path) -> RecipeOutput:
        return _FolderOutput(repo_id, self.token, self.spec)

    def verify_mode(self, asked: Mode) -> Mode:
        return asked


@dataclass(frozen=True)
class StagedHub:
    """``--low-disk`` with a push: each output shard is checked, pre-uploaded to the target and deleted as it is made;
    the target repo exists from the start (one this run created goes again on failure)."""

    plan: Plan
    spec: PushOptions
    token: str | None
    shard_size: int | None
    elsewhere: frozenset[str]
    copies: list[HubCopy] = field(default_factory=list, compare=False)  # the copies of unchanged files, in open order

    def open(self, recipe: Recipe, repo_id: str | None, root: Path) -> RecipeOutput:
        if repo_id is None:
            raise RuntimeError("a staged push without a target repo")  # a push always has one: a bug
        # every recipe's output is open during the one quantization pass: their copies of the unchanged files run
        # one after the other, each after the last one opened
        uploader, created = lowdisk_push.open_uploader(self.plan, repo_id, self.token, self.spec.private, root,
                                                       recipe.tensor_classes, self.shard_size, self.elsewhere,
                                                       after=self.copies[-1] if self.copies else None)
        if uploader.copy is not None:
            self.copies.append(uploader.copy)
        return _StagedOutput(uploader, created, self.token, self.spec.create_pr)

    def verify_mode(self, asked: Mode) -> Mode:
        return "streaming"  # the shards are gone once uploaded: checked tensor by tensor as they were made


def choose(plan: Plan, spec: PushOptions, token: str | None, *, staged: bool, max_shard_size: str | None) -> OutputTarget:
    """The run's output target: staged on the Hub when the run goes --low-disk and pushes, else a folder."""
    shard_size, elsewhere = lowdisk_push.staging(plan, staged, max_shard_size)
    if staged:
        return StagedHub(plan, spec, token, shard_size, elsewhere)
    return LocalFolder(spec, token, shard_size, elsewhere)
