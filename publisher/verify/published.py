"""After the commit: the checks that read what was published (or is about to be merged) back from the Hub.

``check_pull_request``: a --low-disk push, whose shards left the disk after their tensor-by-tensor check,
gets its block-by-block forward and quality figures on the pull request before the merge.
``check_published``: the pushed commit itself is loaded again (whole, or streaming over HTTP range).
``base_sources``: where each component's bf16 base is read for the quality figures.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from publisher import recipes as recipe_registry
from publisher.errors import VerificationError
from publisher.stages import card
from publisher.verify.full import check_location
from publisher.verify.report import VerifyReport


def check_pull_request(run: Any, outcome: Any, revision: str) -> list[Path]:
    """--low-disk push: the shards left the disk after their tensor-by-tensor check, so the block-by-block
    forward (and the quality figures) run on the pull request's commit over HTTP range, before the merge.
    Raises on failure; returns the rewritten card and report, which join the pull request."""
    from publisher.streaming.shards import HubShards
    from publisher.verify.full import quality_against_base
    from publisher.verify.streaming import streaming_check

    artifacts, report = run.done[outcome.recipe]
    uploaded = {c.name for c in artifacts.components if artifacts.uploader.checked.get(c.name)}
    results = []
    for exp in report.expected:
        if exp.component in uploaded:
            r = streaming_check(exp, HubShards(outcome.repo_id, revision, exp.component, run.token), report.tensor_class,
                                forward_optional=artifacts.recipe.run.cuda)
            r.env = "current, pull request before merge"
            results.append(r)
    report.results = [r for r in report.results if r.component not in uploaded] + results
    report.quality = quality_against_base(report.expected, base_sources(run))
    report.passed = not report.failures()
    outcome.report, outcome.verified = report, report.passed
    if not report.passed:
        raise VerificationError(f"verification of {outcome.recipe} failed on the pull request: {report.summary()}; "
                                "it was closed and nothing was merged")
    return card.write_cards(run.plan, run.done, **run.card_args, only=outcome.recipe)


def base_sources(run: Any) -> dict[str, Any]:
    """Where each quantized component's bf16 base is read for the quality figures (one block at a time)."""
    from publisher.streaming.shards import LocalShards

    sources: dict[str, Any] = {}
    for comp in run.plan.quantized:
        local = run.base_dir / comp.name if comp.name else run.base_dir
        downloaded = run.remote is None or any(local.glob("*.safetensors"))
        sources[comp.name] = LocalShards(local) if downloaded else run.remote.source(comp)  # type: ignore[union-attr]
    return sources


def check_published(outcome: Any, report: VerifyReport, work: Path, token: str | None) -> None:
    """Load the published repo itself and compare with the in-memory model again: the library path, or, when the
    folder was verified streaming, tensor by tensor and block by block over HTTP range reads of the commit."""
    if report.mode == "streaming":
        from publisher.streaming.shards import HubShards
        from publisher.verify.streaming import streaming_check

        cuda_recipe = recipe_registry.get(outcome.recipe).run.cuda
        results = [streaming_check(exp, HubShards(outcome.repo_id, outcome.commit, exp.component, token),
                                   report.tensor_class, forward_optional=cuda_recipe) for exp in report.expected]
    else:
        results = check_location(report.expected, outcome.repo_id, outcome.commit, work, token=token,
                                 tensor_class=report.tensor_class, paths=("library",), device=report.device)
    for r in results:
        r.env = "current, from the Hub"
    outcome.published_check = [asdict(r) for r in results]
    bad = [r for r in results if not r.ok]
    if bad:
        outcome.error = f"the published repo {outcome.repo_id} does not reload like the verified folder: {bad[0].detail}"
        raise VerificationError(outcome.error)
