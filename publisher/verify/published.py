"""After the commit: the checks of what was published (or is about to be merged).

``check_published``: the Hub must report, for every file of the pushed commit, the sha256 (LFS) or git blob id
taken here from the verified bytes (``hashes.check_commit``: one API call, no download). With
``--recheck-published`` the commit is also read back and loaded again (whole, or streaming over HTTP range), as
a second, independent check.
``check_pull_request``: a --low-disk push whose forward pass could not run during quantization (its shards left
the disk after their tensor-by-tensor check) gets its block-by-block forward and quality figures on the pull
request, over HTTP range, before the merge.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from publisher.errors import VerificationError
from publisher.handoffs.report import PathResult, VerifyReport
from publisher.streaming.shards import HubShards
from publisher.verify.closeness import quality_against_base
from publisher.verify.commit_hashes import CommitFile, check_commit
from publisher.verify.full import check_location
from publisher.verify.streaming import streaming_check

if TYPE_CHECKING:
    from publisher.handoffs.artifacts import Artifacts
    from publisher.streaming.shards import ShardSource


def needs_pull_request_check(artifacts: Artifacts, report: VerifyReport) -> bool:
    """Whether some uploaded component still needs its forward pass (it could not run during quantization)."""
    return any(artifacts.uploaded(e.component) and e.output is None for e in report.expected)


def check_pull_request(artifacts: Artifacts, report: VerifyReport, repo_id: str, revision: str, token: str | None,
                       base_sources: dict[str, ShardSource]) -> VerifyReport:
    """--low-disk push whose forward pass did not run during quantization: the shards left the disk after their
    tensor-by-tensor check, so the block-by-block forward (and the quality figures) run on the pull request's commit
    over HTTP range, before the merge. Updates ``report``; raises VerificationError when a check fails."""

    todo = {e.component for e in report.expected if artifacts.uploaded(e.component) and e.output is None}
    results = []
    for exp in report.expected:
        if exp.component in todo:
            r = streaming_check(exp, HubShards(repo_id, revision, exp.component, token), report.tensor_class,
                                forward_optional=artifacts.recipe.run.cuda)
            r.env = "current, pull request before merge"
            results.append(r)
    report.results = [r for r in report.results if r.component not in todo] + results
    report.quality = quality_against_base(report.expected, base_sources)
    report.passed = not report.failures()
    if not report.passed:
        raise VerificationError(f"verification of {report.recipe} failed on the pull request: {report.summary()}; "
                                "it was closed and nothing was merged")
    return report


def check_published(report: VerifyReport, repo_id: str, commit: str, work: Path, token: str | None, *,
                    files: dict[str, CommitFile], recheck: bool = False, forward_optional: bool = False) -> list[PathResult]:
    """The Hub's hashes of every file of the pushed commit against ``files`` (taken from the verified bytes); with
    ``recheck``, also load the published repo itself and compare with the in-memory model again: the library path,
    or, when the folder was verified streaming, tensor by tensor and block by block over HTTP range reads
    (``forward_optional``: the recipe runs on a GPU, so a CPU without its kernel costs only the forward check).
    Returns the results; raises PublishedMismatch (naming the first difference) when one fails."""
    results = [check_commit(repo_id, commit, files, token)] if files else []
    if recheck:
        if report.mode == "streaming":
            reloads = [streaming_check(exp, HubShards(repo_id, commit, exp.component, token),
                                       report.tensor_class, forward_optional=forward_optional) for exp in report.expected]
        else:
            reloads = check_location(report.expected, repo_id, commit, work, token=token,
                                     tensor_class=report.tensor_class, paths=("library",), device=report.device)
        for r in reloads:
            r.env = "current, from the Hub"
        results += reloads
    bad = [r for r in results if not r.ok]
    if bad:
        raise PublishedMismatch(f"the published repo {repo_id} does not hold what was verified: {bad[0].detail}",
                                results)
    return results


class PublishedMismatch(VerificationError):
    """The pushed commit does not reload like the verified folder; carries every result for the --json report."""

    def __init__(self, message: str, results: list[PathResult]) -> None:
        super().__init__(message)
        self.results = results
