"""`hf-ao-publish MODEL MODEL... --quant R --on-hf-jobs FLAVOR`: several models, one job per (model, recipe).

    one request per model (for_model)  ->  one preflight of them all, then the jobs (remote.publish_all)
    ->  followed together, each log line prefixed `[model recipe]`  ->  one table (``table``) or one JSON list

Each model's request is the one typed on the command line with its own MODEL; ``for_model`` is the one place that
derives it. A --repo-id with ``{model}`` in it names each model's repo after its base (``alice/{model}-{recipe}``);
without it two models would publish to one repo, which the preflight refuses before any job starts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from publisher.errors import UsageError
from publisher.hfjobs import remote
from publisher.hfjobs.follow import RemoteOutcome
from publisher.quality import options as quality_options
from publisher.request import PublishRequest
from publisher.stages.card import human_size

COLUMNS = ("model", "recipe", "repo", "verified", "size", "quality", "job")


def for_model(req: PublishRequest, model: str) -> PublishRequest:
    """The request for ``model``: the command line's, with its MODEL and its repo id (``{model}``: the base's name)."""
    given = req.target.repo_id
    repo_id = given.replace("{model}", model.rstrip("/").split("/")[-1]) if given else None
    return dataclasses.replace(req, base=dataclasses.replace(req.base, model=model),
                               target=dataclasses.replace(req.target, repo_id=repo_id))


def publish(request: remote.JobsRequest, models: list[str]) -> list[RemoteOutcome]:
    """Every model's plan checked here (a bad model fails the command before any job starts), then one job per
    (model, recipe), followed together."""
    twice = sorted({m for m in models if models.count(m) > 1})
    if twice:
        raise UsageError(f"{', '.join(twice)} is given more than once; name each model once")
    return remote.publish_all([dataclasses.replace(request, publish=for_model(request.publish, m)) for m in models])


def several_models(outcomes: list[Any]) -> bool:
    """Whether a command's results are those of several models' jobs (reported as a table or a JSON list)."""
    return any(getattr(o, "model", "") for o in outcomes)


def entry(outcome: RemoteOutcome) -> dict[str, Any]:
    """One element of the --json list: which model and job, then the job's own --json result."""
    return {"model": outcome.model, "job_id": outcome.job_id, "job_url": outcome.job_url, **outcome.to_json()}


def table(outcomes: list[RemoteOutcome]) -> str:
    """One row per job, in the order they were submitted; columns separated by two spaces."""
    rows = [COLUMNS] + [(o.model, o.recipe, o.repo_id, _verified(o), _size(o.result), _quality(o.result), o.job_url)
                        for o in outcomes]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _verified(outcome: RemoteOutcome) -> str:
    if outcome.error:
        return "FAILED"
    return "yes" if outcome.verified else "no"


def _size(result: dict[str, Any] | None) -> str:
    """The published files' total size, from the job's result ("-" when it printed none)."""
    files = [f for f in (result or {}).get("files") or [] if isinstance(f, dict)]
    return human_size(sum(int(f.get("size") or 0) for f in files)) if files else "-"


def _quality(result: dict[str, Any] | None) -> str:
    """The headline quality figure the card shows: perplexity recovery (a language model) or mean PSNR (a pipeline's
    grid); "-" when the job measured none (--eval-budget 0, or no time for it)."""
    evaluation = (result or {}).get("evaluation") or {}
    if evaluation.get("kind") == quality_options.CAUSAL_LM and evaluation.get("recovery_percent") is not None:
        return f"ppl recovery {evaluation['recovery_percent']:.1f}%"
    psnr = [p for p in evaluation.get("psnr") or [] if p is not None]  # None: identical images (infinite PSNR)
    if evaluation.get("kind") == quality_options.PIPELINE and evaluation.get("psnr"):
        return f"PSNR {sum(psnr) / len(psnr):.1f} dB" if psnr else f"PSNR {math.inf}"
    return "-"
