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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import recipes as recipe_registry
from publisher.errors import Interrupted, PublishError, RunFailed, SourceError, TargetError, VerificationError
from publisher.handoffs.artifacts import Artifacts
from publisher.handoffs.report import ForwardInputs, VerifyReport, require_passed
from publisher.io import hub
from publisher.quality import stage as quality
from publisher.recipes import Recipe
from publisher.request import Outcome, PublishRequest
from publisher.runtime.gcfreeze import frozen_after
from publisher.runtime.heap import bound_heap, peak_rss_bytes
from publisher.stages import card, fetch, lowdisk_push, planning, preflight, unfinished
from publisher.stages import push as pushing
from publisher.stages import quantize as quantize_stage
from publisher.stages import source as source_stage
from publisher.stages.quantize import quantize_recipe
from publisher.stages.unfinished import ComponentCache, default_root, partial_folder, prepare_output
from publisher.state import bytes_key, state_for
from publisher.verify import capture, matrix, published
from publisher.verify.full import verify

if TYPE_CHECKING:
    from publisher.streaming.shards import ShardSource

log = logging.getLogger(__name__)


def resolve_token(token: str | None) -> str | None:
    """--token, else HF_TOKEN / the stored login (huggingface_hub's own lookup)."""
    if token:
        return token
    from huggingface_hub import get_token

    return get_token()


def make_plan(req: PublishRequest, token: str | None, *, check_hardware: bool = True) -> planning.Plan:
    """Everything that can fail cheaply fails here, before any weight is downloaded. ``check_hardware=False``
    when the job runs elsewhere (Hugging Face Jobs: the flavor is checked instead of this machine)."""
    units = planning.precheck_recipes(req.make.quant, req.make.layer_config, check_hardware=check_hardware)  # no torchao yet
    components = planning.mapped_components(units, req.base.components)
    components_from = "--quant" if components and not req.base.components else "--components"
    matrix.check(req.checks.verify_envs, req.checks.compat)
    if req.target.repo_id:
        planning.check_target_id(req.target.repo_id.replace("{recipe}", "x"))
    source_stage.check_named_folder(req.base.model)
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE  # an air-gapped run: nothing of ours asks the Hub
    if req.target.push and offline:
        raise TargetError("HF_HUB_OFFLINE is set and pushing needs the Hub; unset HF_HUB_OFFLINE, or use --no-push")
    if req.target.push and not token:
        raise TargetError("pushing needs a Hub token with write access; set HF_TOKEN (or pass --token), or use --no-push")
    if req.target.output_dir is not None:
        unfinished.check_output_dir(req.target.output_dir)
    src = source_stage.resolve(req.base.model, req.base.revision, token)
    user, who = None, None  # before any file of the base is read: a gated base needs the token's gated access
    if token and not offline:  # offline (no push): no default repo id is asked for, the card says none was chosen
        from publisher.io import hub
        from publisher.io.tokens import TokenRights

        who = hub.call(hub.client(token).whoami, what="checking the token")
        user = who.get("name")
        if src.gated and src.repo_id and (reason := TokenRights.of(who).gated_reason(src.repo_id)) is not None:
            raise SourceError(reason)
    planning.check_layout(src, components, token, req.base.trust_remote_code, components_from)  # model_index.json alone
    recipes = planning.parse_recipes(req.make.quant, req.make.layer_config)  # torchao reads every config: one it rejects stops here
    for recipe in recipes if check_hardware else ():
        recipe_registry.check_can_quantize(recipe)
    targets = planning.target_ids(src, recipes, req.target.repo_id, user)
    options = {"components": req.base.components, "exclude": req.base.exclude}
    plan = planning.build_plan(
        src, recipes, components=components, exclude=list(req.base.exclude), targets=targets, token=token,
        trust_remote_code=req.base.trust_remote_code, options=options, components_from=components_from,
    )
    plan = replace(plan, options={**options, "card": req.card_options(plan.kind)})
    if req.checks.evaluation is not None:  # a bound on a figure this model has not, or cannot get: a usage error, before any download
        quality.options.check_applicable(req.checks.evaluation.bounds, quality.kind_of(plan), f"{req.base.model} ({plan.quantized[0].class_name})")
        quality.check_measurable(req.checks.evaluation, plan, token)
    if req.target.push:  # after the base checks, in the order the preflight promises
        for target in targets.values():
            pushing.check_writable(str(target), token, who)  # a push has a token, so every target is named
    return plan


def run(req: PublishRequest) -> list[Outcome]:
    bound_heap()  # before any worker thread exists: they would each get a heap arena
    token = resolve_token(req.token)
    with frozen_after():  # the plan imports torch & co (runtime/gcfreeze.py)
        plan = make_plan(req, token)
    outcomes = [Outcome(recipe=r.name, repo_id=plan.targets[r.name]) for r in plan.recipes]
    try:
        return _run_plan(req, plan, token, outcomes)
    except Exception as exc:  # re-raised as RunFailed, which carries the outcomes so far (for --json)
        for outcome in outcomes:
            if outcome.folder is not None and not outcome.folder.exists():
                outcome.folder = None
        raise RunFailed(exc, outcomes) from exc
    except KeyboardInterrupt as exc:  # SIGINT / SIGTERM (publisher.runtime.signals): the cleanup ran; say what stays
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        stop.left = unfinished.kept_for_resume(plan, [bytes_key(state_for(plan, r)) for r in plan.recipes]) + stop.left
        raise stop from None


@dataclass(frozen=True)
class Shared:
    """What every recipe of one publish run reads: made once, after the download, before the first recipe."""

    req: PublishRequest
    plan: planning.Plan
    token: str | None
    base_dir: Path
    work: Path  # the run's temporary folder (verification workers, forward inputs)
    out_root: Path
    capability: tuple[int, int] | None
    remote: fetch.RemoteWeights | None  # --low-disk: quantized components' weights read by HTTP range
    gating_envs: list[matrix.Env]  # --verify-env
    inputs: dict[str, ForwardInputs]  # forward-check inputs, derived once from the base
    evaluation: quality.Evaluation | None
    shard_size: int | None  # output shard size in bytes (None: the library's default)
    elsewhere: frozenset[str]  # unchanged base files copied Hub to Hub (--low-disk push)

    def base_sources(self) -> dict[str, ShardSource]:
        return fetch.base_sources(self.plan, self.base_dir, self.remote)


def _run_plan(req: PublishRequest, plan: planning.Plan, token: str | None, outcomes: list[Outcome]) -> list[Outcome]:
    runs = [RecipeRun(r, o, state_for(plan, r)) for r, o in zip(plan.recipes, outcomes)]
    todo = [r for r in runs if not r.up_to_date(req, token)]
    if not todo:
        return outcomes

    auto_dir = req.target.output_dir is None
    from huggingface_hub import constants

    text = quality.read_text(req.checks.evaluation, plan, token) if req.checks.evaluation else None  # one request, before the download

    if req.target.low_disk and plan.source.local_dir is not None:
        log.info("--low-disk has no effect on a local base folder: its weights are already on disk")
    estimate = preflight.check(plan, req.target.output_dir or Path(tempfile.gettempdir()), Path(constants.HF_HUB_CACHE),
                               req.make.engine, req.target.low_disk, req.target.push, req.make.max_shard_size)
    preflight.check_low_disk(estimate.low_disk, req.target.push, benchmark=req.checks.benchmark, verify_envs=bool(req.checks.verify_envs))
    remote = fetch.RemoteWeights(plan, token) if estimate.low_disk else None
    # Environments are built before the download: a spec that cannot be built stops the run while it is cheap.
    gating, measured = matrix.prepare(req.checks.verify_envs, req.checks.compat, {r.recipe.name: r.recipe.tensor_classes for r in todo},
                                      {c.library for c in plan.quantized},
                                      measure=not ((estimate.low_disk and req.target.push) or req.checks.verify_mode == "streaming"))
    for r in todo:
        r.compat_envs = measured.get(r.recipe.name, [])
    shard_size, elsewhere = lowdisk_push.staging(plan, estimate.low_disk and req.target.push, req.make.max_shard_size)
    started = time.monotonic()
    base_dir = fetch.fetch(plan, token, skip=(remote.files if remote is not None else frozenset()) | elsewhere)
    for outcome in outcomes:
        outcome.seconds["download"] = round(time.monotonic() - started, 3)
        outcome.rss_after["download"] = peak_rss_bytes()
    out_root = Path(tempfile.mkdtemp(prefix="hf-ao-publish-")) if auto_dir else req.target.output_dir
    assert out_root is not None
    existed = out_root.exists()
    work_dir = tempfile.TemporaryDirectory(prefix="hf-ao-verify-")
    work, capability = Path(work_dir.name), recipe_registry.cuda_capability()
    try:
        with _timed(outcomes[0], "inputs"):  # one derivation for every recipe: the same base, the same call
            inputs = capture.prepare(plan, base_dir, work / "inputs")
            evaluation = (quality.Evaluation(req.checks.evaluation, text, plan, base_dir, elsewhere, token, work)
                          if req.checks.evaluation is not None else None)
        shared = Shared(req, plan, token, base_dir, work, out_root, capability, remote, gating, inputs, evaluation,
                        shard_size, elsewhere)
        for r in todo:
            try:
                r.build(shared)
            except PublishError as exc:
                r.failed(shared, exc)
                if not req.keep_going:
                    raise
                log.error("%s: %s (continuing: --keep-going)", r.recipe.name, exc)
        _write_cards(shared, todo)
        for r in todo:
            r.finish(shared)
        for r in todo:
            if r.done:
                r.outcome.files = r.done[0].files()
            else:  # removed, or never finished: nothing there passes for a repo
                r.outcome.folder = None
        if req.target.push:
            for r in todo:
                if r.done:
                    r.push(shared, todo)
    except BaseException as exc:
        for r in todo:  # --low-disk push: repos made for recipes never pushed
            r.discard_created(token)
        if isinstance(exc, KeyboardInterrupt):
            unfinished.discard_unfinished(out_root, [r.folder for r in todo if r.folder is not None], auto_dir=auto_dir,
                                          existed=existed, exc=exc)
        raise
    finally:
        work_dir.cleanup()
        if auto_dir and req.target.push:
            shutil.rmtree(out_root, ignore_errors=True)
            for outcome in outcomes:
                outcome.folder = None
    return outcomes


def _write_cards(shared: Shared, runs: Sequence[RecipeRun], only: str | None = None) -> list[Path]:
    """The cards of every built recipe, each linking to its siblings (``only``: rewrite that recipe's card)."""
    req = shared.req
    built = [r for r in runs if r.done]
    return card.write_cards(
        shared.plan, {r.recipe.name: r.result for r in built}, {r.recipe.name: r.outcome.quality for r in built},
        {r.recipe.name: r.outcome.benchmark for r in built}, command=req.command, endpoint=hub.endpoint(),
        sample={"prompt": req.checks.sample_prompt, "steps": req.checks.sample_steps, "size": req.checks.sample_size},
        evaluation=req.checks.evaluation, only=only, folders={r.recipe.name: r.folder for r in built if r.folder},
        shard_size=shared.shard_size)


@dataclass
class RecipeRun:
    """One recipe's way through the stages, and what it holds on the way."""

    recipe: Recipe
    outcome: Outcome
    state: dict[str, Any]  # publisher.state.state_for: what decides this recipe's repo
    previous: dict[str, Any] | None = None  # the target's state file before this run (for the commit description)
    compat_envs: list[matrix.Env] | None = field(default_factory=list)  # its compatibility matrix (None: --compat none)
    folder: Path | None = None  # its final repo folder, once prepared
    cache: ComponentCache | None = None  # its resume cache, once quantizing began
    uploader: lowdisk_push.ShardUploader | None = None  # --low-disk push: shards go to the target as they are made
    created: bool = False  # --low-disk push: the target repo was created by this run and not yet pushed
    done: tuple[Artifacts, VerifyReport] | None = None  # once built: verified, measured and gated

    @property
    def result(self) -> tuple[Artifacts, VerifyReport]:
        if self.done is None:
            raise RuntimeError(f"{self.recipe.name} was not built")  # a bug in the sequence, not a user error
        return self.done

    def up_to_date(self, req: PublishRequest, token: str | None) -> bool:
        """A re-run with nothing changed is a no-op: checked before any download. Records the target's previous
        state (for the commit description) on the way; said once, by the CLI's summary line."""
        if not req.target.push:
            return False
        same, self.previous = pushing.up_to_date(self.outcome.target(), token, self.state["fingerprint"],
                                                 create_pr=req.target.create_pr, force=req.target.force)
        if same is None or self.previous is None:
            return False
        outcome = self.outcome
        outcome.up_to_date, outcome.verified, outcome.commit = True, bool(self.previous.get("verified", True)), same.commit
        outcome.url, outcome.pr_url = same.url, same.pr_url
        return True

    def build(self, shared: Shared) -> None:
        """The local stages: quantize, verify, compatibility, repo files, measurements, quality figures and gate.
        --low-disk with a push: the output shards and the unchanged base files go to the target as the run goes
        (lowdisk_push), so the target repo exists from the start; one this run created goes again on failure."""
        self.folder = self.outcome.folder = prepare_output(shared.out_root, self.recipe, len(shared.plan.recipes) > 1)
        if shared.remote is not None and shared.req.target.push:
            self.uploader, self.created = lowdisk_push.open_uploader(
                shared.plan, self.outcome.target(), shared.token, shared.req.target.private,
                partial_folder(self.folder, shared.out_root), self.recipe.tensor_classes, shared.shard_size,
                shared.elsewhere)
        try:
            self._build_stages(shared, self.folder)
            if self.uploader is not None:
                self.outcome.copied = self.uploader.finish_copy()
        except BaseException:
            if self.uploader is not None:
                self.uploader.close()
                self.discard_created(shared.token)
            raise

    def _build_stages(self, shared: Shared, folder: Path) -> None:
        req, outcome, recipe = shared.req, self.outcome, self.recipe
        device = recipe_registry.device(recipe, shared.capability)
        with _timed(outcome, "quantize"):
            self.cache = ComponentCache(default_root(), bytes_key(self.state))
            artifacts = quantize_recipe(shared.plan, shared.base_dir, recipe, partial_folder(folder, shared.out_root),
                                        device, engine=req.make.engine, cache=self.cache, remote=shared.remote,
                                        uploader=self.uploader, fingerprint=self.state["fingerprint"],
                                        max_shard_size=shared.shard_size, elsewhere=shared.elsewhere,
                                        inputs=shared.inputs,
                                        observer=shared.evaluation.observer if shared.evaluation else None)
        # nothing quantized is an error unless accepted
        quantize_stage.report_layers(artifacts, shared.base_dir, req.make.allow_unquantized)
        outcome.components = [c.to_json(artifacts.layers[c.name].to_dict()) for c in artifacts.components]
        work = shared.work / recipe.name
        with _timed(outcome, "verify"):
            report = verify(artifacts, work, envs=[e.pair for e in shared.gating_envs], base_sources=shared.base_sources(),
                            token=shared.token, device=device,
                            mode="streaming" if self.uploader is not None else req.checks.verify_mode, inputs=shared.inputs)
        outcome.report = report
        outcome.verified = report.passed
        require_passed(report)
        with _timed(outcome, "compat"):
            matrix.measure(report, str(artifacts.folder), None, work, self.compat_envs, shared.gating_envs,
                           token=shared.token, device=device)
        building = artifacts.folder  # the .partial folder until finalize()
        pushing.write_repo_files(building, dict(self.state, verified=report.passed))
        if device == "cuda" or req.checks.benchmark:
            from publisher.stages.measure import measure

            with _timed(outcome, "benchmark"):
                outcome.benchmark = measure(artifacts.components, report.expected, building, shared.base_dir, device)
        if shared.evaluation is not None and req.checks.evaluation is not None:  # the figures, then the gate: before any push
            with _timed(outcome, "evaluation"):
                outcome.quality = shared.evaluation.run(artifacts, shared.base_sources(), outcome.seconds["quantize"],
                                                        recipe)
            quality.gate(req.checks.evaluation, outcome.quality, recipe.name)
        self.done = (artifacts, report)

    def failed(self, shared: Shared, exc: PublishError) -> None:
        """After a failed build: say why, never reuse what failed verification, leave nothing half-made behind."""
        self.outcome.error = str(exc)
        if isinstance(exc, VerificationError) and self.cache is not None:
            self.cache.drop([c.name for c in shared.plan.quantized])
        if self.folder is not None:
            shutil.rmtree(partial_folder(self.folder, shared.out_root), ignore_errors=True)

    def finish(self, shared: Shared) -> None:
        """The built folder takes its final name, with its report; without a push it is the result."""
        if self.done is None or self.folder is None:
            return
        unfinished.finish(*self.done, self.folder)
        if not shared.req.target.push and self.cache is not None:  # nothing left to resume
            self.cache.drop([c.name for c in shared.plan.quantized])

    def discard_created(self, token: str | None) -> None:
        """--low-disk push: a target repo this run created goes again (once; not after its push took it over)."""
        if self.created:  # only then is there a target (--no-push may have none)
            self.created = False
            lowdisk_push.discard(self.outcome.target(), token, True)

    def push(self, shared: Shared, siblings: Sequence[RecipeRun]) -> None:
        """Publish the built folder; ``siblings``: every recipe of the run, for a card rewritten on the way."""
        artifacts, report = self.result
        outcome, req = self.outcome, shared.req
        state = dict(self.state, verified=report.passed)
        message, description = pushing.commit_text(shared.plan.source, self.recipe.name, self.previous, state,
                                                   forced=req.target.force)
        started = time.monotonic()
        try:
            if isinstance(artifacts.uploader, lowdisk_push.ShardUploader):  # --low-disk: shards already uploaded
                created, self.created = self.created, False
                result = lowdisk_push.push_staged(
                    artifacts.folder, report, artifacts.uploader, token=shared.token, create_pr=req.target.create_pr,
                    message=message, description=description, created=created,
                    check=lambda oid: self.check_pull_request(shared, siblings, oid))
            else:
                result = pushing.push(
                    artifacts.folder, report, repo_id=outcome.target(), token=shared.token, private=req.target.private,
                    create_pr=req.target.create_pr, message=message, description=description, state=state, force=req.target.force,
                )
        except Exception as exc:  # re-raised: the outcome records the one-line reason for --json
            from publisher.messages import describe

            outcome.error = (describe(exc) or (f"{type(exc).__name__}: {exc}", 1))[0]
            raise
        outcome.url, outcome.commit, outcome.pr_url = result.url, result.commit, result.pr_url
        outcome.up_to_date, outcome.pushed = result.up_to_date, not result.up_to_date
        outcome.files = artifacts.files()
        outcome.seconds["push"] = round(time.monotonic() - started, 3)
        if self.cache is not None:  # published: nothing to resume
            self.cache.drop([c.name for c in shared.plan.quantized])
        if outcome.pushed and not req.target.create_pr:
            with _timed(outcome, "published_check"):
                try:
                    results = published.check_published(
                        report, outcome.target(), str(outcome.commit), shared.work / self.recipe.name, shared.token,
                        files=result.files, recheck=req.target.recheck_published, forward_optional=artifacts.recipe.run.cuda)
                except published.PublishedMismatch as exc:
                    outcome.published_check, outcome.error = [asdict(r) for r in exc.results], str(exc)
                    raise
                outcome.published_check = [asdict(r) for r in results]

    def check_pull_request(self, shared: Shared, siblings: Sequence[RecipeRun], revision: str) -> list[Path]:
        """--low-disk push: the forward check and quality figures on the pull request of a component whose forward
        could not run during quantization; returns the rewritten card and report, which join the pull request."""
        artifacts, report = self.result
        if not published.needs_pull_request_check(artifacts, report):
            return []
        try:
            published.check_pull_request(artifacts, report, self.outcome.target(), revision, shared.token,
                                         shared.base_sources())
        finally:
            self.outcome.report, self.outcome.verified = report, report.passed
        return _write_cards(shared, siblings, only=self.recipe.name)


@contextmanager
def _timed(outcome: Outcome, stage: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        outcome.seconds[stage] = round(time.monotonic() - started, 3)
        outcome.rss_after[stage] = peak_rss_bytes()
