"""`hf-ao-publish MODEL --quant R --on-hf-jobs FLAVOR`: the same publish, run on Hugging Face Jobs.

    preflight here (flavor vs recipes, base, target, token)  ->  ship this code (package.py)
    ->  one job per recipe, in parallel (bootstrap.py runs the CLI there)  ->  follow them (follow.py)

The token reaches a job only as its HF_TOKEN secret: never in its command, its environment or a log. Each job
runs `hf-ao-publish publish MODEL --quant R --repo-id TARGET --revision SHA ... --json` on the base commit and
target this machine checked, and the --json result a user gets is the one the job printed.
"""

from __future__ import annotations

import json
import logging
import secrets as random_tokens
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from publisher import recipe_args
from publisher.errors import RunFailed, TargetError, UsageError
from publisher.flavors import Flavor
from publisher.hfjobs import bootstrap, hardware, jobchecks, package
from publisher.hfjobs.follow import Follower, JobFailed, RemoteOutcome, stage_name, terminate_as_interrupt
from publisher.io import hub
from publisher.io.tokens import resolve_token
from publisher.request import PublishRequest
from publisher.stages.planning import make_plan
from publisher.stages.source import is_local

if TYPE_CHECKING:
    from huggingface_hub import HfApi

    from publisher.handoffs.plan import Plan
    from publisher.recipes import Recipe

log = logging.getLogger(__name__)

IMAGE = "python:3.11"  # Docker Hub's official image: Python and pip; torch's wheels bring their own CUDA libraries
TORCH_INDEX = "https://download.pytorch.org/whl/"
DEFAULT_TIMEOUT = "2h"  # the service's own default (30 minutes) is short for a multi-GB model
TOOL_LABEL = "hf-ao-publish"


@dataclass(frozen=True)
class JobsRequest:
    """A remote publish: the local request, the flavor, and the CLI options the job's command repeats."""

    publish: PublishRequest
    flavor: str
    timeout: str = DEFAULT_TIMEOUT
    options: tuple[str, ...] = ()  # CLI options for every job (not --quant/--repo-id/--revision/--json)


def torch_for(flavor: Flavor) -> dict[str, str]:
    """torch as pinned by this project, in the build for the flavor: PyPI's default wheel is the CUDA build
    (GPU flavors); CPU flavors take the CPU build, a fraction of the download."""
    import importlib.metadata as md

    version = md.version("torch").split("+")[0]
    return {"requirement": f"torch=={version}", "index_url": "" if flavor.gpu else TORCH_INDEX + "cpu"}


def _job_env() -> dict[str, str]:
    import os

    env = {"PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    endpoint = hub.endpoint()
    if endpoint != "https://huggingface.co":  # a private Hub deployment (or the tests' loopback Hub)
        env["HF_ENDPOINT"] = endpoint
    if os.environ.get("HF_HUB_DISABLE_XET"):  # the user's choice of transfer path holds for the job too
        env["HF_HUB_DISABLE_XET"] = os.environ["HF_HUB_DISABLE_XET"]
    return env


def _submit(api: HfApi, spec: Mapping[str, object], recipe: str, flavor: Flavor, timeout: str, namespace: str,
            token: str) -> tuple[str, str, str]:
    """Start one job; returns (id, url, stage). A retried request finds its first try by a one-off label."""
    submission = random_tokens.token_hex(8)
    labels = {"tool": TOOL_LABEL, "recipe": recipe, "submission": submission}

    def already() -> tuple[str, str, str] | None:
        found = next(iter(api.list_jobs(labels={"submission": submission}, namespace=namespace, token=token)), None)
        return (found.id, found.url, stage_name(found.status.stage)) if found is not None else None

    def start() -> tuple[str, str, str]:
        info = api.run_job(image=IMAGE, command=["python", "-c", Path(bootstrap.__file__).read_text(encoding="utf-8"),
                                                 json.dumps(spec)],
                           env=_job_env(), secrets={"HF_TOKEN": token}, flavor=flavor.name, timeout=timeout,
                           labels=labels, name=f"hf-ao-publish-{recipe}", namespace=namespace, token=token)
        return info.id, info.url, stage_name(info.status.stage)

    return hub.call(start, what=f"starting the {recipe} job on {flavor.name}", check=already)


def job_args(request: JobsRequest, recipe: Recipe, target: str, sha: str | None) -> list[str]:
    """The command line of the job that publishes ``recipe``: the same request as this machine's, with the recipe's
    configs inline (no local file), the target and base commit checked here, every other option as given here (those
    read from an environment variable too: the job has none of this machine's)."""
    return ["publish", request.publish.base.model, *recipe.job_args(), "--repo-id", target,
            *(["--revision", sha] if sha else []), *request.options, "--json"]


def publish(request: JobsRequest) -> list[RemoteOutcome]:
    """Check everything here, ship the code, start one job per recipe and follow them to their end."""
    return publish_all([request])


def publish_all(requests: list[JobsRequest]) -> list[RemoteOutcome]:
    """One job per (model, recipe) of every request: every request is checked here before the first job is
    submitted (a bad model fails the command with no job started), the code is shipped once, and the jobs are
    followed together. The requests share their flavor, timeout, token and --keep-going."""
    first = requests[0].publish
    for request in requests:
        if is_local(request.publish.base.model):
            raise UsageError(f"{request.publish.base.model} is a local folder, which a Job cannot read; upload it to the "
                             "Hub first (hf upload NAMESPACE/NAME FOLDER) and pass the repo id")
    recipes = {r.name: r for request in requests for r in recipe_args.parse(request.publish.make.quant, request.publish.make.layer_config)}
    token = resolve_token(first.token)
    if not token:
        raise TargetError("a publish on Hugging Face Jobs needs a Hub token that can write and start Jobs; set "
                          "HF_TOKEN (or pass --token)")
    flavors, source = hardware.available(token)
    flavor = jobchecks.check_flavor(list(recipes.values()), requests[0].flavor, flavors)
    log.info("flavor %s (from %s) fits %s", flavor.describe(), "the Hub's hardware list" if source == "hub"
             else "the built-in table", ", ".join(recipes))
    runs = [(request, make_plan(request.publish, token, check_hardware=False)) for request in requests]
    _check_distinct_targets(runs)
    api = hub.client(token)
    who = hub.call(api.whoami, what="checking the token")
    namespace = str(who.get("name"))
    jobchecks.check_token_can_run_jobs(who, namespace)
    shipped = package.ship(namespace, token)
    outcomes: list[RemoteOutcome] = []
    follower = Follower(outcomes, namespace, token, keep_going=first.keep_going)
    with terminate_as_interrupt():
        return _start_and_follow(follower, runs, flavor, shipped)


def _check_distinct_targets(runs: list[tuple[JobsRequest, Plan]]) -> None:
    """Two jobs that would push to one repo would overwrite each other: refused before any is submitted."""
    seen: dict[str, str] = {}
    for request, plan in runs:
        for recipe, target in plan.targets.items():
            this = f"{request.publish.base.model} {recipe}"
            if target is not None and seen.setdefault(target, this) != this:
                raise UsageError(f"{seen[target]} and {this} would both publish to {target}; give each model its own "
                                 "--repo-id (with several models, put {model} in it: NAMESPACE/{model}-{recipe})")


def _start_and_follow(follower: Follower, runs: list[tuple[JobsRequest, Plan]], flavor: Flavor,
                      shipped: package.ShippedWheel) -> list[RemoteOutcome]:
    """One job per (model, recipe), then follow them all. Whatever stops this between two submissions cancels the
    jobs already started: none runs on, billed, without someone following it."""
    outcomes, several = follower.outcomes, len(runs) > 1
    api, namespace, token = follower.api, follower.namespace, follower.token
    try:
        for request, plan in runs:
            for recipe in plan.recipes:
                target = plan.targets[recipe.name]
                if target is None:  # a Job always pushes, so its token chose a target at plan time
                    raise TargetError(f"{recipe.name}: no target repo id was chosen; pass --repo-id NAMESPACE/NAME")
                spec = {"endpoint": hub.endpoint(), "args": job_args(request, recipe, target, plan.source.sha),
                        "torch": torch_for(flavor), "constraints": package.constraints(),
                        "wheel": {"path": shipped.path, "sha256": shipped.sha256}}
                job_id, url, stage = _submit(api, spec, recipe.name, flavor, request.timeout, namespace, token)
                model = request.publish.base.model if several else ""  # named in messages only when several models run
                outcomes.append(RemoteOutcome(recipe.name, target, job_id, url, flavor.name, stage, model=model))
                log.info("started job %s for %s%s on %s: %s", job_id, f"{model} " if model else "", recipe.name,
                         flavor.name, url)
    except KeyboardInterrupt:
        raise follower.interrupted() from None
    except BaseException:  # a later submission failed: the jobs already started must not run on, billed
        follower.cancel(outcomes, "the submission of the other jobs failed")
        raise
    try:
        log.info("following %d job(s); if this connection is lost, follow again with: hf-ao-publish %s",
                 len(outcomes), " ".join(f"--attach {o.job_id}" for o in outcomes))
        return _settled(follower.run(), follower.keep_going)
    except KeyboardInterrupt:  # before the follower's own handler was in place
        raise follower.interrupted() from None


def attach(job_ids: list[str], token: str | None, keep_going: bool = True) -> list[RemoteOutcome]:
    """Follow jobs started by an earlier `--on-hf-jobs` again (after a lost connection): the whole log, then
    the same report and --json result as the command that started them."""
    token = resolve_token(token)
    if not token:
        raise TargetError("following a job needs the Hub token of its owner; set HF_TOKEN (or pass --token)")
    api = hub.client(token)
    namespace = str(hub.call(api.whoami, what="checking the token").get("name"))
    outcomes = []
    for job_id in dict.fromkeys(job_ids):
        info = hub.call(api.inspect_job, job_id=job_id, namespace=namespace, token=token, what=f"reading the job {job_id}")
        labels = info.labels or {}
        if labels.get("tool") != TOOL_LABEL or not labels.get("recipe"):
            raise UsageError(f"job {job_id} was not started by hf-ao-publish --on-hf-jobs (it has no recipe label); "
                             "follow it with `hf jobs logs` instead")
        outcomes.append(RemoteOutcome(labels["recipe"], _target(info), info.id, info.url, str(info.flavor or ""),
                                      stage_name(info.status.stage), model=_model(info)))
    if len({o.model for o in outcomes}) == 1:  # one model: reported as the command that started them reported it
        for outcome in outcomes:
            outcome.model = ""
    with terminate_as_interrupt():
        return _settled(Follower(outcomes, namespace, token, keep_going=keep_going).run(), keep_going)


def _job_arg(info: object, after: str) -> str:
    """The argument after ``after`` in the job's CLI command line (its spec is the last element of its command)."""
    command = getattr(info, "command", None) or []
    try:
        args = json.loads(command[-1]).get("args", [])
        return str(args[args.index(after) + 1])
    except (ValueError, IndexError, AttributeError, TypeError):
        return "?"


def _target(info: object) -> str:
    return _job_arg(info, "--repo-id")


def _model(info: object) -> str:
    return _job_arg(info, "publish")  # `publish MODEL --quant ...` (job_args)


def _settled(outcomes: list[RemoteOutcome], keep_going: bool) -> list[RemoteOutcome]:
    """Without --keep-going, a failed job fails the command (as a failed recipe does locally)."""
    failed = [o for o in outcomes if o.error]
    if failed and not keep_going:
        raise RunFailed(JobFailed(failed[0].error or "a job failed"), outcomes)
    return outcomes
