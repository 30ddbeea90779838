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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from publisher import __version__, hub
from publisher import recipes as recipe_registry
from publisher.errors import Interrupted, PublishError, ResourceError, RunFailed, SourceError, TargetError, VerificationError
from publisher.handoffs.artifacts import Artifacts
from publisher.handoffs.report import ForwardInputs, Mode, VerifyReport, require_passed
from publisher.quality import stage as quality
from publisher.recipes import Recipe
from publisher.stages import card, fetch, lowdisk_push, preflight, unfinished
from publisher.stages import plan as planning
from publisher.stages import push as pushing
from publisher.stages import quantize as quantize_stage
from publisher.stages import source as source_stage
from publisher.stages.quantize import quantize_recipe
from publisher.stages.unfinished import ComponentCache, default_root, finalize, partial_folder, prepare_output
from publisher.state import bytes_key, state_for
from publisher.streaming.engine import bound_heap
from publisher.verify import capture, matrix, published
from publisher.verify.full import verify

log = logging.getLogger(__name__)

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
    quality: Any = None  # quality.stage figures (perplexity and continuation, or the grid)
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
            "peak_rss_bytes": _peak_rss(),
            "error": self.error,
        }


def resolve_token(token: str | None) -> str | None:
    """--token, else HF_TOKEN / the stored login (huggingface_hub's own lookup)."""
    if token:
        return token
    from huggingface_hub import get_token

    return get_token()


def card_options(req: PublishRequest, kind: str) -> dict[str, Any]:
    """The options that change only the card (its snippet, measurements and tables), for the plan's kind: a re-run
    that changes one of them is not up to date. Steps and size are a pipeline snippet's only."""
    options: dict[str, Any] = {"sample_prompt": req.sample_prompt, "benchmark": req.benchmark,
                               "compat": list(req.compat or ("default",)), "verify_envs": list(req.verify_envs),
                               "evaluation": req.evaluation.to_dict() if req.evaluation else None}
    if kind == "pipeline":
        options.update(sample_steps=req.sample_steps, sample_size=req.sample_size)
    return options


def make_plan(req: PublishRequest, token: str | None, *, check_hardware: bool = True) -> planning.Plan:
    """Everything that can fail cheaply fails here, before any weight is downloaded. ``check_hardware=False``
    when the job runs elsewhere (Hugging Face Jobs: the flavor is checked instead of this machine)."""
    units = planning.precheck_recipes(req.quant, req.layer_config, check_hardware=check_hardware)  # no torchao yet
    components = planning.mapped_components(units, req.components)
    components_from = "--quant" if components and not req.components else "--components"
    matrix.check(req.verify_envs, req.compat)
    if req.repo_id:
        planning.check_target_id(req.repo_id.replace("{recipe}", "x"))
    if req.push and not token:
        raise TargetError("pushing needs a Hub token with write access; set HF_TOKEN (or pass --token), or use --no-push")
    if req.output_dir is not None:
        unfinished.check_output_dir(req.output_dir)
    src = source_stage.resolve(req.model, req.revision, token)
    user, who = None, None  # before any file of the base is read: a gated base needs the token's gated access
    if token:
        from publisher import hub
        from publisher.tokens import TokenRights

        who = hub.call(hub.client(token).whoami, what="checking the token")
        user = who.get("name")
        if src.gated and src.repo_id and (reason := TokenRights.of(who).gated_reason(src.repo_id)) is not None:
            raise SourceError(reason)
    planning.check_layout(src, components, token, req.trust_remote_code, components_from)  # model_index.json alone
    recipes = planning.parse_recipes(req.quant, req.layer_config)  # torchao reads every config: one it rejects stops here
    for recipe in recipes if check_hardware else ():
        recipe_registry.check_can_quantize(recipe)
    targets = planning.target_ids(src, recipes, req.repo_id, user)
    options = {"components": req.components, "exclude": req.exclude}
    plan = planning.build_plan(
        src, recipes, components=components, exclude=list(req.exclude), targets=targets, token=token,
        trust_remote_code=req.trust_remote_code, options=options, components_from=components_from,
    )
    plan = replace(plan, options={**options, "card": card_options(req, plan.kind)})
    if req.evaluation is not None:  # a bound on a figure this model has not: a usage error, before any download
        quality.spec.check_applicable(req.evaluation.bounds, quality.kind_of(plan), f"{req.model} ({plan.quantized[0].class_name})")
    if req.push:  # after the base checks, in the order the preflight promises
        for target in targets.values():
            pushing.check_writable(str(target), token, who)  # a push has a token, so every target is named
    return plan


def run(req: PublishRequest) -> list[Outcome]:
    bound_heap()  # before any worker thread exists: they would each get a heap arena
    token = resolve_token(req.token)
    plan = make_plan(req, token)
    outcomes = [Outcome(recipe=r.name, repo_id=plan.targets[r.name]) for r in plan.recipes]
    try:
        return _run_plan(req, plan, token, outcomes)
    except Exception as exc:  # re-raised as RunFailed, which carries the outcomes so far (for --json)
        for outcome in outcomes:
            if outcome.folder is not None and not outcome.folder.exists():
                outcome.folder = None
        raise RunFailed(exc, outcomes) from exc
    except KeyboardInterrupt as exc:  # SIGINT / SIGTERM (publisher.signals): the cleanup ran; say what stays
        stop = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        stop.left = unfinished.kept_for_resume(plan, [bytes_key(state_for(plan, r)) for r in plan.recipes]) + stop.left
        raise stop from None


@dataclass
class _Run:
    """What the stages of one publish run share."""

    req: PublishRequest
    plan: planning.Plan
    token: str | None
    states: dict[str, dict[str, Any]]
    out_root: Path
    base_dir: Path
    work: Path
    capability: tuple[int, int] | None
    remote: fetch.RemoteWeights | None = None  # --low-disk: quantized components' weights read by HTTP range
    gating_envs: list[matrix.Env] = field(default_factory=list)  # --verify-env
    compat_envs: dict[str, list[matrix.Env] | None] = field(default_factory=dict)  # recipe -> its matrix (None: none)
    done: dict[str, tuple[Artifacts, VerifyReport]] = field(default_factory=dict)
    evaluation: quality.Evaluation | None = None
    finals: dict[str, Path] = field(default_factory=dict)
    caches: dict[str, ComponentCache] = field(default_factory=dict)
    created: dict[str, bool] = field(default_factory=dict)  # --low-disk push: target repo created by this run
    card_args: dict[str, Any] = field(default_factory=dict)  # how the cards were written (to rewrite one later)
    inputs: dict[str, ForwardInputs] = field(default_factory=dict)  # forward-check inputs, derived once from the base
    shard_size: int | None = None  # output shard size in bytes (None: the library's default)
    elsewhere: frozenset[str] = frozenset()  # unchanged base files copied Hub to Hub (--low-disk push)


def _run_plan(req: PublishRequest, plan: planning.Plan, token: str | None, outcomes: list[Outcome]) -> list[Outcome]:
    states = {r.name: state_for(plan, r) for r in plan.recipes}
    previous: dict[str, dict[str, Any] | None] = {}
    todo = [r for r, o in zip(plan.recipes, outcomes) if not _up_to_date(req, o, states[r.name], previous, token)]
    if not todo:
        return outcomes

    auto_dir = req.output_dir is None
    from huggingface_hub import constants

    if req.low_disk and plan.source.local_dir is not None:
        log.info("--low-disk has no effect on a local base folder: its weights are already on disk")
    estimate = preflight.check(plan, req.output_dir or Path(tempfile.gettempdir()), Path(constants.HF_HUB_CACHE),
                               req.engine, req.low_disk, req.push, req.max_shard_size)
    if estimate.low_disk and req.benchmark:
        raise ResourceError("the base does not fit on disk, so its weights would be read by HTTP range, but "
                            "--benchmark needs it whole; drop it or free disk space")
    if estimate.low_disk and req.push and req.verify_envs:
        raise ResourceError("the base does not fit on disk, so shards would be uploaded and deleted as they are made, "
                            "but --verify-env needs them whole on disk; drop --verify-env or free disk space")
    remote = fetch.RemoteWeights(plan, token) if estimate.low_disk else None
    text = quality.read_text(req.evaluation, plan, token) if req.evaluation else None  # before the download
    # Environments are built before the download: a spec that cannot be built stops the run while it is cheap.
    gating, measured = matrix.prepare(req.verify_envs, req.compat, {r.name: r.tensor_classes for r in todo},
                                      {c.library for c in plan.quantized},
                                      measure=not ((estimate.low_disk and req.push) or req.verify_mode == "streaming"))
    shard_size, elsewhere = lowdisk_push.staging(plan, estimate.low_disk and req.push, req.max_shard_size)
    started = time.monotonic()
    base_dir = fetch.fetch(plan, token, skip=(remote.files if remote is not None else frozenset()) | elsewhere)
    for outcome in outcomes:
        outcome.seconds["download"] = round(time.monotonic() - started, 3)
        outcome.rss_after["download"] = _peak_rss()["process"]
    out_root = Path(tempfile.mkdtemp(prefix="hf-ao-publish-")) if auto_dir else req.output_dir
    assert out_root is not None
    existed = out_root.exists()
    work_dir = tempfile.TemporaryDirectory(prefix="hf-ao-verify-")
    run = _Run(req, plan, token, states, out_root, base_dir, Path(work_dir.name), recipe_registry.cuda_capability(),
               remote, gating, measured, shard_size=shard_size, elsewhere=elsewhere)
    try:
        with _timed(outcomes[0], "inputs"):  # one derivation for every recipe: the same base, the same call
            run.inputs = capture.prepare(plan, base_dir, run.work / "inputs")
            if req.evaluation is not None:
                run.evaluation = quality.Evaluation(req.evaluation, text, plan, base_dir, elsewhere, token, run.work)
        for recipe in todo:
            outcome = next(o for o in outcomes if o.recipe == recipe.name)
            try:
                _build(run, recipe, outcome)
            except PublishError as exc:
                outcome.error = str(exc)
                if isinstance(exc, VerificationError) and recipe.name in run.caches:
                    run.caches[recipe.name].drop([c.name for c in plan.quantized])  # never reuse what failed
                if recipe.name in run.finals:  # nothing half-made stays behind
                    shutil.rmtree(partial_folder(run.finals[recipe.name], out_root), ignore_errors=True)
                if not req.keep_going:
                    raise
                log.error("%s: %s (continuing: --keep-going)", recipe.name, exc)
        run.card_args = dict(evaluations={o.recipe: o.quality for o in outcomes}, evaluation=req.evaluation,
                             benchmarks={o.recipe: o.benchmark for o in outcomes}, command=req.command,
                             sample={"prompt": req.sample_prompt, "steps": req.sample_steps, "size": req.sample_size},
                             endpoint=hub.endpoint(), folders=dict(run.finals), shard_size=run.shard_size)
        card.write_cards(plan, run.done, **run.card_args)
        for name, (artifacts, report) in run.done.items():
            finalize(artifacts, run.finals[name])
            report.location = "."  # the repo folder itself: a machine's path would be published (and vary)
            report.write(artifacts.folder)
            if not req.push:  # the finished folder is the result: nothing left to resume
                run.caches[name].drop([c.name for c in plan.quantized])
        for outcome in outcomes:
            if outcome.recipe not in run.done:
                outcome.folder = None  # removed, or never finished: nothing there passes for a repo
            elif outcome.folder is not None:
                outcome.files = run.done[outcome.recipe][0].files()
        if req.push:
            for outcome in outcomes:
                if outcome.recipe in run.done:
                    _push_one(run, outcome, previous.get(outcome.recipe))
    except BaseException as exc:
        for name, created in run.created.items():  # --low-disk push: repos made for recipes never pushed
            lowdisk_push.discard(str(plan.targets[name]), token, created)
        if isinstance(exc, KeyboardInterrupt):
            unfinished.discard_unfinished(out_root, run.finals, auto_dir=auto_dir, existed=existed, exc=exc)
        raise
    finally:
        work_dir.cleanup()
        if auto_dir and req.push:
            shutil.rmtree(out_root, ignore_errors=True)
            for outcome in outcomes:
                outcome.folder = None
    return outcomes


def _up_to_date(req: PublishRequest, outcome: Outcome, state: dict[str, Any],
                previous: dict[str, dict[str, Any] | None], token: str | None) -> bool:
    """A re-run with nothing changed is a no-op: checked before any download. Records the target's
    previous state (for the commit message) on the way."""
    if not req.push:
        return False
    # With --create-pr the state that counts is our open PR's, when there is one.
    pr = pushing.find_open_pr(outcome.target(), token) if req.create_pr else None
    head, prev = pushing.published_state(outcome.target(), token, pr[1] if pr else None)
    previous[outcome.recipe] = prev
    if not ((pr or not req.create_pr) and prev and prev.get("fingerprint") == state["fingerprint"]):
        return False
    if req.force:
        log.info("%s is up to date; publishing it again (--force)", outcome.target())
        return False
    outcome.up_to_date, outcome.verified, outcome.commit = True, bool(prev.get("verified", True)), head
    outcome.url = f"{hub.endpoint()}/{outcome.target()}"
    outcome.pr_url = f"{outcome.url}/discussions/{pr[0]}" if pr else None
    return True  # said once, by the CLI's summary line


def _build(run: _Run, recipe: Recipe, outcome: Outcome) -> None:
    """The local stages for one recipe: quantize, verify, state file, measurements, quality figures and gate. --low-disk with a push: the
    output shards and the unchanged base files go to the target as the run goes (lowdisk_push), so the target repo exists
    from the start; one this run created goes again on failure."""
    req, plan = run.req, run.plan
    folder = prepare_output(run.out_root, recipe, len(plan.recipes) > 1)
    outcome.folder = folder
    run.finals[recipe.name] = folder
    uploader = None
    if run.remote is not None and req.push:
        uploader, run.created[recipe.name] = lowdisk_push.open_uploader(
            plan, outcome.target(), run.token, req.private, partial_folder(folder, run.out_root),
            recipe.tensor_classes, run.shard_size, run.elsewhere)
    try:
        _build_stages(run, recipe, outcome, folder, uploader)
        if uploader is not None:
            outcome.copied = uploader.finish_copy()
    except BaseException:
        if uploader is not None:
            uploader.close()
            lowdisk_push.discard(uploader.repo_id, run.token, run.created.pop(recipe.name, False))
        raise


def _build_stages(run: _Run, recipe: Recipe, outcome: Outcome, folder: Path, uploader: lowdisk_push.ShardUploader | None) -> None:
    req, plan = run.req, run.plan
    run_on = recipe_registry.run_device(recipe, run.capability)
    with _timed(outcome, "quantize"):
        cache = run.caches[recipe.name] = ComponentCache(default_root(), bytes_key(run.states[recipe.name]))
        artifacts = quantize_recipe(plan, run.base_dir, recipe, partial_folder(folder, run.out_root),
                                    recipe_registry.quantize_device(recipe, run.capability), engine=req.engine, cache=cache,
                                    remote=run.remote, uploader=uploader, fingerprint=run.states[recipe.name]["fingerprint"],
                                    max_shard_size=run.shard_size, elsewhere=run.elsewhere, inputs=run.inputs,
                                    observer=run.evaluation.observer if run.evaluation else None)
    quantize_stage.report_layers(artifacts, run.base_dir, req.allow_unquantized)  # nothing quantized is an error unless accepted
    outcome.components = [c.to_json(artifacts.layers[c.name].to_dict()) for c in artifacts.components]
    with _timed(outcome, "verify"):
        report = verify(artifacts, run.work / recipe.name, envs=[e.pair for e in run.gating_envs],
                        base_sources=fetch.base_sources(plan, run.base_dir, run.remote),
                        token=run.token, device=run_on, mode="streaming" if uploader is not None else req.verify_mode,
                        inputs=run.inputs)
    outcome.report = report
    outcome.verified = report.passed
    require_passed(report)
    with _timed(outcome, "compat"):
        matrix.measure(report, str(artifacts.folder), None, run.work / recipe.name, run.compat_envs.get(recipe.name, []),
                       run.gating_envs, token=run.token, device=run_on)
    building = artifacts.folder  # the .partial folder until finalize()
    pushing.write_repo_files(building, dict(run.states[recipe.name], verified=report.passed))
    if run_on == "cuda" or req.benchmark:
        from publisher.stages.measure import measure

        with _timed(outcome, "benchmark"):
            outcome.benchmark = measure(artifacts.components, report.expected, building, run.base_dir, run_on)
    if run.evaluation is not None and req.evaluation is not None:  # the figures, then the gate: before any push
        with _timed(outcome, "evaluation"):
            outcome.quality = run.evaluation.run(artifacts, fetch.base_sources(plan, run.base_dir, run.remote),
                                                 outcome.seconds["quantize"], recipe)
        quality.gate(req.evaluation, outcome.quality, recipe.name)
    run.done[recipe.name] = (artifacts, report)


def _push_one(run: _Run, outcome: Outcome, previous: dict[str, Any] | None) -> None:
    artifacts, report = run.done[outcome.recipe]
    state = dict(run.states[outcome.recipe], verified=report.passed)
    src = run.plan.source
    message = f"Quantize {src.repo_id or src.local_dir.name}@{(src.sha or 'local')[:12]} with torchao {outcome.recipe}"  # type: ignore[union-attr]
    started = time.monotonic()
    description = pushing.changes(previous, state, forced=run.req.force) + f"\n\nMade with hf-ao-publish {__version__}."
    try:
        if isinstance(artifacts.uploader, lowdisk_push.ShardUploader):  # --low-disk: shards already uploaded
            result = lowdisk_push.push_staged(
                artifacts.folder, report, artifacts.uploader, token=run.token, create_pr=run.req.create_pr,
                message=message, description=description, created=run.created.pop(outcome.recipe, False),
                check=lambda oid: _check_pull_request(run, outcome, oid))
        else:
            result = pushing.push(
                artifacts.folder, report, repo_id=outcome.target(), token=run.token, private=run.req.private,
                create_pr=run.req.create_pr, message=message, description=description, state=state, force=run.req.force,
            )
    except Exception as exc:  # re-raised: the outcome records the one-line reason for --json
        from publisher.messages import describe

        outcome.error = (describe(exc) or (f"{type(exc).__name__}: {exc}", 1))[0]
        raise
    outcome.url, outcome.commit, outcome.pr_url = result.url, result.commit, result.pr_url
    outcome.up_to_date, outcome.pushed = result.up_to_date, not result.up_to_date
    outcome.files = artifacts.files()
    outcome.seconds["push"] = round(time.monotonic() - started, 3)
    run.caches[outcome.recipe].drop([c.name for c in run.plan.quantized])  # published: nothing to resume
    if outcome.pushed and not run.req.create_pr:
        with _timed(outcome, "published_check"):
            try:
                results = published.check_published(report, outcome.target(), str(outcome.commit), run.work / outcome.recipe,
                                                    run.token, files=result.files, recheck=run.req.recheck_published,
                                                    forward_optional=artifacts.recipe.run.cuda)
            except published.PublishedMismatch as exc:
                outcome.published_check, outcome.error = [asdict(r) for r in exc.results], str(exc)
                raise
            outcome.published_check = [asdict(r) for r in results]


def _check_pull_request(run: _Run, outcome: Outcome, revision: str) -> list[Path]:
    """--low-disk push: the forward check and quality figures on the pull request of a component whose forward could
    not run during quantization; returns the rewritten card and report, which join the pull request (or nothing)."""
    artifacts, report = run.done[outcome.recipe]
    if not published.needs_pull_request_check(artifacts, report):
        return []
    try:
        published.check_pull_request(artifacts, report, outcome.target(), revision, run.token,
                                     fetch.base_sources(run.plan, run.base_dir, run.remote))
    finally:
        outcome.report, outcome.verified = report, report.passed
    return card.write_cards(run.plan, run.done, **run.card_args, only=outcome.recipe)


@contextmanager
def _timed(outcome: Outcome, stage: str) -> Iterator[None]:
    import resource

    started = time.monotonic()
    try:
        yield
    finally:
        outcome.seconds[stage] = round(time.monotonic() - started, 3)
        outcome.rss_after[stage] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss() -> dict[str, int]:
    """Peak resident memory of this process and of the largest finished child (verification workers)."""
    import resource

    return {"process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}

