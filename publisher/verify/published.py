"""After the commit: the checks that read what was published (or is about to be merged) back from the Hub.

``check_pull_request``: a --low-disk push, whose shards left the disk after their tensor-by-tensor check,
gets its block-by-block forward and quality figures on the pull request before the merge.
``check_published``: the pushed commit itself is loaded again (whole, or streaming over HTTP range).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from publisher import recipes as recipe_registry
from publisher.errors import VerificationError
from publisher.verify.full import check_location, quality_against_base
from publisher.verify.report import PathResult, VerifyReport

if TYPE_CHECKING:
    from publisher.stages.quantize import Artifacts
    from publisher.streaming.shards import ShardSource


def check_pull_request(artifacts: Artifacts, report: VerifyReport, repo_id: str, revision: str, token: str | None,
                       base_sources: dict[str, ShardSource]) -> VerifyReport:
    """--low-disk push: the shards left the disk after their tensor-by-tensor check, so the block-by-block
    forward (and the quality figures) run on the pull request's commit over HTTP range, before the merge.
    Updates ``report`` with the results; raises VerificationError when a check fails."""
    from publisher.streaming.shards import HubShards
    from publisher.verify.streaming import streaming_check

    checked = artifacts.uploader.checked if artifacts.uploader is not None else {}
    uploaded = {c.name for c in artifacts.components if checked.get(c.name)}
    results = []
    for exp in report.expected:
        if exp.component in uploaded:
            r = streaming_check(exp, HubShards(repo_id, revision, exp.component, token), report.tensor_class,
                                forward_optional=artifacts.recipe.run.cuda)
            r.env = "current, pull request before merge"
            results.append(r)
    report.results = [r for r in report.results if r.component not in uploaded] + results
    report.quality = quality_against_base(report.expected, base_sources)
    report.passed = not report.failures()
    if not report.passed:
        raise VerificationError(f"verification of {report.recipe} failed on the pull request: {report.summary()}; "
                                "it was closed and nothing was merged")
    return report


def check_published(report: VerifyReport, repo_id: str, commit: str, work: Path, token: str | None) -> list[PathResult]:
    """Load the published repo itself and compare with the in-memory model again: the library path, or, when the
    folder was verified streaming, tensor by tensor and block by block over HTTP range reads of the commit.
    Returns the results; raises VerificationError (naming the first difference) when one fails."""
    if report.mode == "streaming":
        from publisher.streaming.shards import HubShards
        from publisher.verify.streaming import streaming_check

        cuda_recipe = recipe_registry.get(report.recipe).run.cuda
        results = [streaming_check(exp, HubShards(repo_id, commit, exp.component, token),
                                   report.tensor_class, forward_optional=cuda_recipe) for exp in report.expected]
    else:
        results = check_location(report.expected, repo_id, commit, work, token=token,
                                 tensor_class=report.tensor_class, paths=("library",), device=report.device)
    for r in results:
        r.env = "current, from the Hub"
    bad = [r for r in results if not r.ok]
    if bad:
        raise PublishedMismatch(f"the published repo {repo_id} does not reload like the verified folder: {bad[0].detail}",
                                results)
    return results


class PublishedMismatch(VerificationError):
    """The pushed commit does not reload like the verified folder; carries every result for the --json report."""

    def __init__(self, message: str, results: list[PathResult]) -> None:
        super().__init__(message)
        self.results = results
