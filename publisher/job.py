"""The publish job: source -> plan -> preflight -> fetch -> quantize -> verify -> card -> push, typed hand-offs.

This module sequences the stages; each stage lives in its own module. Library code raises
PublishError (or huggingface_hub's errors); the CLI turns them into one-line messages.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import recipes as recipe_registry
from publisher.errors import Interrupted, PublishError, RunFailed, TargetError, VerificationError
from publisher.handoffs.artifacts import Artifacts
from publisher.handoffs.report import ForwardInputs, VerifyReport, require_passed
from publisher.io import hub
from publisher.io.tokens import resolve_token
from publisher.messages import describe
from publisher.quality import stage as quality
from publisher.recipes import Recipe
from publisher.request import NO_TARGET, Outcome, PublishRequest
from publisher.runtime.gcfreeze import frozen_after
from publisher.runtime.heap import bound_heap, peak_rss_bytes
from publisher.stages import card, fetch, planning, preflight, unfinished
from publisher.stages import push as pushing
from publisher.stages import quantize as quantize_stage
from publisher.stages.measure import Bf16Rows, measure
from publisher.stages.output import OutputTarget, PushOptions, RecipeOutput
from publisher.stages.output import choose as choose_output
from publisher.stages.quantize import RecipeTarget, quantize_recipes
from publisher.stages.unfinished import ComponentCache, default_root, partial_folder, prepare_output
from publisher.state import bytes_key, state_for
from publisher.verify import capture, matrix, published, workers
from publisher.verify.full import verify

if TYPE_CHECKING:
    from publisher.quality.grid import GridFigures
    from publisher.quality.lm import LmFigures
    from publisher.stages.push import PushResult
    from publisher.streaming.shards import ShardSource

log = logging.getLogger(__name__)


def run(req: PublishRequest) -> list[Outcome]:
    """The publish: plan, then every recipe through the stages; each recipe's Outcome is made from what its stages
    returned (RecipeRun.outcome)."""
    bound_heap()  # before any worker thread exists: they would each get a heap arena
    token = resolve_token(req.token)
    with frozen_after():  # the plan imports torch & co (runtime/gcfreeze.py)
        plan = planning.make_plan(req, token)
    runs = [RecipeRun(r, plan.targets[r.name], state_for(plan, r)) for r in plan.recipes]
    try:
        todo = [r for r in runs if not r.up_to_date(req, token)]
        if todo:
            _run_recipes(req, plan, token, todo)
    except Exception as exc:  # re-raised as RunFailed, which carries the outcomes so far (for --json)
        raise RunFailed(exc, [r.outcome() for r in runs]) from exc
    except KeyboardInterrupt as exc:  # SIGINT / SIGTERM (publisher.runtime.signals): the cleanup ran; say what stays
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        stop.left = unfinished.kept_for_resume(plan, [bytes_key(state_for(plan, r)) for r in plan.recipes]) + stop.left
        raise stop from None
    return [r.outcome() for r in runs]


@dataclass(frozen=True)
class RunContext:
    """What every recipe of one publish run reads: made once, after the download, before the first recipe."""

    req: PublishRequest
    plan: planning.Plan
    token: str | None
    base_dir: Path
    work: Path  # the run's temporary folder (verification workers, forward inputs)
    out_root: Path
    capability: tuple[int, int] | None
    remote: fetch.RemoteWeights | None  # --low-disk: quantized components' weights read by HTTP range
    output: OutputTarget  # a local folder, or the target staged shard by shard
    gating_envs: list[matrix.Env]  # --verify-env
    inputs: dict[str, ForwardInputs]  # forward-check inputs, derived once from the base
    evaluation: quality.Evaluation | None
    bf16_rows: Bf16Rows = field(default_factory=Bf16Rows)  # the benchmark's bf16 rows: measured once per run

    def base_sources(self) -> dict[str, ShardSource]:
        return fetch.base_sources(self.plan, self.base_dir, self.remote)


def _run_recipes(req: PublishRequest, plan: planning.Plan, token: str | None, todo: list[RecipeRun]) -> None:
    """Preflight, environments, download, then build every recipe, write the cards, finish, push."""
    from huggingface_hub import constants

    checks, target = req.checks, req.target
    text = quality.read_text(checks.evaluation, plan, token) if checks.evaluation else None  # one request, before the download
    if target.low_disk and plan.source.local_dir is not None:
        log.info("--low-disk has no effect on a local base folder: its weights are already on disk")
    estimate = preflight.check(plan, target.output_dir or Path(tempfile.gettempdir()), Path(constants.HF_HUB_CACHE),
                               req.make.engine, target.low_disk, target.push, req.make.max_shard_size)
    preflight.check_low_disk(estimate.low_disk, target.push, benchmark=checks.benchmark, verify_envs=bool(checks.verify_envs))
    remote = fetch.RemoteWeights(plan, token) if estimate.low_disk else None
    output = choose_output(plan, PushOptions(target.private, target.create_pr, target.force), token,
                           staged=estimate.low_disk and target.push, max_shard_size=req.make.max_shard_size)
    # Environments are built before the download: a spec that cannot be built stops the run while it is cheap.
    gating, measured = matrix.prepare(checks.verify_envs, checks.compat, {r.recipe.name: r.recipe.tensor_classes for r in todo},
                                      {c.library for c in plan.quantized},
                                      measure=output.verify_mode(checks.verify_mode) != "streaming")
    for r in todo:
        r.compat_envs = measured.get(r.recipe.name, [])
    started = time.monotonic()
    base_dir = fetch.fetch(plan, token, skip=(remote.files if remote is not None else frozenset()) | output.elsewhere)
    for r in todo:
        r.seconds["download"] = round(time.monotonic() - started, 3)
        r.rss_after["download"] = peak_rss_bytes()
    auto_dir = target.output_dir is None
    out_root = Path(tempfile.mkdtemp(prefix="hf-ao-publish-")) if target.output_dir is None else target.output_dir
    existed = out_root.exists()
    work_dir = tempfile.TemporaryDirectory(prefix="hf-ao-verify-")
    work = Path(work_dir.name)
    try:
        with _timed(todo[0], "inputs"):  # one derivation for every recipe: the same base, the same call
            inputs = capture.prepare(plan, base_dir, work / "inputs")
            evaluation = (quality.Evaluation(checks.evaluation, text, plan, base_dir, output.elsewhere, token, work)
                          if checks.evaluation is not None else None)
        ctx = RunContext(req, plan, token, base_dir, work, out_root, recipe_registry.cuda_capability(), remote, output,
                         gating, inputs, evaluation)
        _build(ctx, todo)
        _write_cards(ctx, todo)
        for r in todo:
            r.finish(ctx)
        for r in todo if target.push else ():
            if r.built:
                r.push(ctx, todo)
    except BaseException as exc:
        for r in todo:  # a staged target: repos made for recipes never pushed
            r.abandon()
        if isinstance(exc, KeyboardInterrupt):
            unfinished.discard_unfinished(out_root, [r.folder for r in todo if r.folder is not None], auto_dir=auto_dir,
                                          existed=existed, exc=exc)
        raise
    finally:
        work_dir.cleanup()
        if auto_dir and target.push:  # a temporary folder: nothing of it is the result
            shutil.rmtree(out_root, ignore_errors=True)
            for r in todo:
                r.folder_kept = False


def _build(ctx: RunContext, todo: list[RecipeRun]) -> None:
    """Every recipe's folder and output opened, one quantization pass for them all (each base tensor read once,
    stages/quantize.quantize_recipes) when the streaming engine takes every component, then each recipe verified,
    measured and gated in turn; else one recipe after the other. A recipe that fails stops the run, or with
    --keep-going is reported and left out while the others go on."""
    opened = [r for r in todo if _step(ctx, r, partial(r.open, ctx))]
    targets = [r.quantize_target(ctx) for r in opened]
    if quantize_stage.one_pass(ctx.plan, ctx.base_dir, targets, ctx.req.make.engine, ctx.remote):
        _quantize_and_build(ctx, opened, targets)
        return
    for r, t in zip(opened, targets):  # the library path holds a model per recipe until it is verified: one at a time
        _quantize_and_build(ctx, [r], [t])


def _quantize_and_build(ctx: RunContext, runs: list[RecipeRun], targets: list[RecipeTarget]) -> None:
    # the verification's interpreters import torch & co while the recipes quantize (on the CPU the zygote then serves
    # them all; a GPU load takes one interpreter started ahead per load path and recipe)
    for device in dict.fromkeys(t.device for t in targets):
        workers.start_early(ctx.token, device, ctx.output.verify_mode(ctx.req.checks.verify_mode),
                            max((c.param_bytes for c in ctx.plan.quantized), default=0),
                            recipes=sum(t.device == device for t in targets))
    started = time.monotonic()
    got = quantize_recipes(ctx.plan, ctx.base_dir, targets, engine=ctx.req.make.engine, remote=ctx.remote,
                           max_shard_size=ctx.output.shard_size, elsewhere=ctx.output.elsewhere, inputs=ctx.inputs,
                           observer=ctx.evaluation.observer if ctx.evaluation else None)
    for r in runs:  # a shared pass: its time is every recipe's
        r.seconds["quantize"] = round(time.monotonic() - started, 3)
        r.rss_after["quantize"] = peak_rss_bytes()
    # failures first: without --keep-going the run stops before the others are verified
    for r, artifacts in sorted(zip(runs, got), key=lambda pair: isinstance(pair[1], Artifacts)):
        _step(ctx, r, partial(r.build, ctx, artifacts))


def _step(ctx: RunContext, r: RecipeRun, step: Callable[[], None]) -> bool:
    """One recipe's step; its PublishError stops the run, or with --keep-going is reported (False) and the run goes on."""
    try:
        step()
    except PublishError as exc:
        r.failed(ctx, exc)
        if not ctx.req.keep_going:
            raise
        log.error("%s: %s (continuing: --keep-going)", r.recipe.name, exc)
        return False
    return True


def _write_cards(ctx: RunContext, runs: Sequence[RecipeRun], only: str | None = None) -> list[Path]:
    """The cards of every built recipe, each linking to its siblings (``only``: rewrite that recipe's card)."""
    checks = ctx.req.checks
    built = {r.recipe.name: card.Built(*r.result, r.quality, r.benchmark, r.folder) for r in runs if r.built}
    settings = card.CardSettings(ctx.req.command, checks.sample, hub.endpoint(), checks.evaluation, ctx.output.shard_size)
    return card.write_cards(ctx.plan, built, settings, only)


@dataclass
class RecipeRun:
    """One recipe's way through the stages: what each stage returned, from which its Outcome is made."""

    recipe: Recipe
    repo_id: str | None  # its target (None: none chosen, --no-push without a token or --repo-id)
    state: dict[str, Any]  # publisher.state.state_for: what decides this recipe's repo
    previous: dict[str, Any] | None = None  # the target's state file before this run (for the commit description)
    same: PushResult | None = None  # the target already holds this state: nothing to do
    compat_envs: list[matrix.Env] | None = field(default_factory=list)  # its compatibility matrix (None: --compat none)
    folder: Path | None = None  # its final repo folder, once prepared
    partial: Path | None = None  # where it is built until it is finished (stages/unfinished.py), once prepared
    folder_kept: bool = True  # False once a temporary output folder was removed
    cache: ComponentCache | None = None  # its resume cache, once quantizing began
    output: RecipeOutput | None = None  # where its files go, once its build began
    artifacts: Artifacts | None = None  # quantized (and the report verified) ...
    report: VerifyReport | None = None
    built: bool = False  # ... then measured and gated: ready for the card and the push
    finished: bool = False  # the folder took its final name
    benchmark: dict[str, Any] | None = None  # stages.measure result
    quality: LmFigures | GridFigures | None = None  # quality.stage figures
    copied: list[dict[str, Any]] = field(default_factory=list)  # a staged push: files copied Hub to Hub
    files: dict[str, int] = field(default_factory=dict)  # the repo's files and sizes, when finished and when pushed
    pushed: PushResult | None = None
    published_check: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)  # stage wall times
    rss_after: dict[str, int] = field(default_factory=dict)  # this process's peak RSS at the end of each stage

    @property
    def result(self) -> tuple[Artifacts, VerifyReport]:
        if not self.built or self.artifacts is None or self.report is None:
            raise RuntimeError(f"{self.recipe.name} was not built")  # a bug in the sequence, not a user error
        return self.artifacts, self.report

    def target(self) -> str:  # the repo id a push writes to (a push always has one: it needs a token)
        if self.repo_id is None:
            raise TargetError(f"{self.recipe.name}: {NO_TARGET}")
        return self.repo_id

    def outcome(self) -> Outcome:
        """What happened, from what the stages returned (the --json result and the summary line)."""
        done = self.pushed or self.same
        folder = self.folder if self.finished and self.folder_kept and self.folder and self.folder.exists() else None
        return Outcome(
            recipe=self.recipe.name, repo_id=self.repo_id, folder=folder,
            url=done.url if done else None, commit=done.commit if done else None, pr_url=done.pr_url if done else None,
            verified=(bool((self.previous or {}).get("verified", True)) if self.same is not None
                      else self.report is not None and self.report.passed),
            up_to_date=self.same is not None or bool(self.pushed and self.pushed.up_to_date),
            pushed=bool(self.pushed and not self.pushed.up_to_date), error=self.error,
            files=self.files,
            components=([c.to_json(self.artifacts.layers[c.name].to_dict()) for c in self.artifacts.components]
                        if self.artifacts is not None else []),
            report=self.report, published_check=self.published_check, seconds=self.seconds, rss_after=self.rss_after,
            benchmark=self.benchmark, quality=self.quality, copied=self.copied)

    def up_to_date(self, req: PublishRequest, token: str | None) -> bool:
        """A re-run with nothing changed is a no-op: checked before any download. Records the target's previous
        state (for the commit description) on the way; said once, by the CLI's summary line."""
        if not req.target.push:
            return False
        same, self.previous = pushing.up_to_date(self.target(), token, self.state["fingerprint"],
                                                 create_pr=req.target.create_pr, force=req.target.force)
        if same is not None and self.previous is not None:
            self.same = same
        return self.same is not None

    def open(self, ctx: RunContext) -> None:
        """Its final folder's name, and where its files go (a staged target: the repo exists from here on)."""
        self.folder = prepare_output(ctx.out_root, self.recipe, len(ctx.plan.recipes) > 1)
        self.partial = partial_folder(self.folder, ctx.out_root)
        self.output = ctx.output.open(self.recipe, self.repo_id, self.partial)

    def quantize_target(self, ctx: RunContext) -> RecipeTarget:
        """What the quantize stage needs of this recipe: its unfinished folder, device, resume cache, uploader."""
        assert self.partial is not None and self.output is not None  # opened
        self.cache = ComponentCache(default_root(), bytes_key(self.state))
        return RecipeTarget(self.recipe, self.partial,
                            recipe_registry.device(self.recipe, ctx.capability), self.cache, self.output.uploader,
                            self.state["fingerprint"])

    def build(self, ctx: RunContext, quantized: Artifacts | PublishError) -> None:
        """The local stages after the shared quantization pass (``quantized``: what it made of this recipe, or why it
        failed): verify, compatibility, repo files, measurements, quality figures and gate."""
        assert self.folder is not None and self.output is not None  # opened
        try:
            if not isinstance(quantized, Artifacts):
                raise quantized
            self._build_stages(ctx, quantized)
            self.copied = self.output.finish()
        except BaseException:
            self.abandon()
            raise

    def _build_stages(self, ctx: RunContext, artifacts: Artifacts) -> None:
        req, recipe = ctx.req, self.recipe
        device = recipe_registry.device(recipe, ctx.capability)
        # nothing quantized is an error unless accepted
        quantize_stage.report_layers(artifacts, ctx.base_dir, req.make.allow_unquantized)
        self.artifacts = artifacts
        work = ctx.work / recipe.name
        with _timed(self, "verify"):
            self.report = report = verify(artifacts, work, envs=[e.pair for e in ctx.gating_envs],
                                          base_sources=ctx.base_sources(), token=ctx.token, device=device,
                                          mode=ctx.output.verify_mode(req.checks.verify_mode), inputs=ctx.inputs)
        require_passed(report)
        with _timed(self, "compat"):
            matrix.measure(report, str(artifacts.folder), None, work, self.compat_envs, ctx.gating_envs,
                           token=ctx.token, device=device)
        building = artifacts.folder  # the .partial folder until finalize()
        pushing.write_repo_files(building, dict(self.state, verified=report.passed))
        if device == "cuda" or req.checks.benchmark:
            with _timed(self, "benchmark"):
                self.benchmark = measure(artifacts.components, report.expected, building, ctx.base_dir, device,
                                         bf16=ctx.bf16_rows, recipe=recipe.name)
        settings = req.checks.evaluation
        if ctx.evaluation is not None and settings is not None:  # the figures, then the gate: before any push
            with _timed(self, "evaluation"):
                self.quality = ctx.evaluation.run(artifacts, ctx.base_sources(), self.seconds["quantize"], recipe)
            quality.gate(settings, self.quality, recipe.name)
        self.built = True

    def failed(self, ctx: RunContext, exc: PublishError) -> None:
        """After a failed build: say why, never reuse what failed verification, leave nothing half-made behind."""
        self.error = str(exc)
        if isinstance(exc, VerificationError) and self.cache is not None:
            self.cache.drop([c.name for c in ctx.plan.quantized])
        if self.partial is not None:
            shutil.rmtree(self.partial, ignore_errors=True)

    def finish(self, ctx: RunContext) -> None:
        """The built folder takes its final name, with its report; without a push it is the result."""
        if not self.built or self.folder is None:
            return
        artifacts, report = self.result
        unfinished.finish(artifacts, report, self.folder)
        self.finished, self.files = True, artifacts.files()
        if not ctx.req.target.push and self.cache is not None:  # nothing left to resume
            self.cache.drop([c.name for c in ctx.plan.quantized])

    def abandon(self) -> None:
        """A staged target this run created goes again (once; not after its push took it over)."""
        if self.output is not None:
            self.output.abandon()

    def push(self, ctx: RunContext, siblings: Sequence[RecipeRun]) -> None:
        """Publish the built folder; ``siblings``: every recipe of the run, for a card rewritten on the way."""
        artifacts, report = self.result
        assert self.output is not None
        spec = ctx.req.target
        state = dict(self.state, verified=report.passed)
        message, description = pushing.commit_text(ctx.plan.source, self.recipe.name, self.previous, state,
                                                   forced=spec.force)
        started = time.monotonic()
        try:
            result = self.output.publish(artifacts, report, message=message, description=description, state=state,
                                         check=lambda oid: self.check_pull_request(ctx, siblings, oid))
        except Exception as exc:  # re-raised: the outcome records the one-line reason for --json
            self.error = (describe(exc) or (f"{type(exc).__name__}: {exc}", 1))[0]
            raise
        self.pushed, self.files = result, artifacts.files()
        self.seconds["push"] = round(time.monotonic() - started, 3)
        if self.cache is not None:  # published: nothing to resume
            self.cache.drop([c.name for c in ctx.plan.quantized])
        if not result.up_to_date and not spec.create_pr:
            with _timed(self, "published_check"):
                try:
                    results = published.check_published(
                        report, self.target(), str(result.commit), ctx.work / self.recipe.name, ctx.token,
                        files=result.files, recheck=spec.recheck_published, forward_optional=artifacts.recipe.run.cuda)
                except published.PublishedMismatch as exc:
                    self.published_check, self.error = [asdict(r) for r in exc.results], str(exc)
                    raise
                self.published_check = [asdict(r) for r in results]

    def check_pull_request(self, ctx: RunContext, siblings: Sequence[RecipeRun], revision: str) -> list[Path]:
        """A staged push: the forward check and quality figures on the pull request of a component whose forward
        could not run during quantization; returns the rewritten card and report, which join the pull request."""
        artifacts, report = self.result
        if not published.needs_pull_request_check(artifacts, report):
            return []
        try:
            published.check_pull_request(artifacts, report, self.target(), revision, ctx.token, ctx.base_sources())
        finally:
            self.report = report
        return _write_cards(ctx, siblings, only=self.recipe.name)


@contextmanager
def _timed(run: RecipeRun, stage: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        run.seconds[stage] = round(time.monotonic() - started, 3)
        run.rss_after[stage] = peak_rss_bytes()
