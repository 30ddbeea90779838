"""--low-disk with a push: output shards leave the disk as soon as they are finished and checked.

Each finished safetensors shard of a streamed component is checked tensor by tensor against the
digests the engine recorded in memory (torchao's own unflatten, the recipe's class, bit for bit),
pre-uploaded to the target repo's LFS storage (``HfApi.preupload_lfs_files``: no commit) and deleted,
so the disk holds about one output shard at a time. A tensor whose parts span two shards is checked
when its last shard is finished; the earlier shard waits for it.

Nothing is visible on the repo's main branch until the end: ``push_staged`` commits everything (these
pre-uploaded shards plus the local files) as a pull request, runs the block-by-block forward check on
the PR over HTTP range, commits the card with its results to the PR, and merges it only when that
passes. The repo must exist before the first pre-upload: one created by this run is deleted again
if the run fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import hub
from publisher.errors import VerificationError

if TYPE_CHECKING:
    from publisher.stages.push import PushResult
    from publisher.verify.report import VerifyReport

log = logging.getLogger(__name__)


class ShardUploader:
    """One target repo; ``for_component`` gives the engine's callbacks for one streamed component."""

    def __init__(self, repo_id: str, token: str | None, root: Path, tensor_class: str) -> None:

        self.api, self.repo_id, self.root, self.tensor_class = hub.client(token), repo_id, root, tensor_class
        self.ops: dict[str, Any] = {}  # path in repo -> pre-uploaded CommitOperationAdd
        self.sizes: dict[str, int] = {}  # path in repo -> bytes (the local file is gone)
        self.checked: dict[str, int] = {}  # component -> tensors checked before upload
        self.classes: dict[str, int] = {}  # component -> quantized layers of the recipe's class

    def for_component(self, name: str, folder: Path, digests: dict[str, str]) -> _Component:
        return _Component(self, name, folder, digests)

    def uploaded_bytes(self, folder: Path) -> int:
        prefix = folder.relative_to(self.root).as_posix()
        prefix = "" if prefix == "." else prefix + "/"
        return sum(size for rel, size in self.sizes.items() if rel.startswith(prefix) and "/" not in rel[len(prefix):])

    def upload(self, path: Path) -> None:
        """Pre-upload one checked shard, then delete it (LFS files only: a regular file is read again at commit)."""
        from huggingface_hub import CommitOperationAdd

        rel = path.relative_to(self.root).as_posix()
        op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path))
        hub.call(self.api.preupload_lfs_files, self.repo_id, additions=[op], free_memory=False,
                   what=f"uploading {rel} to {self.repo_id}")
        size = path.stat().st_size
        if not (op._upload_mode == "lfs" and op._is_uploaded):  # the Hub takes it as a regular file: at the commit
            log.info("%s (%.1f MB) stays on disk until the commit (not an LFS file for %s)", rel, size / 1e6, self.repo_id)
            return
        path.unlink()  # called from the engine's one writer thread: no other writer
        self.ops[rel], self.sizes[rel] = op, size
        log.info("uploaded %s (%.1f MB) to %s before the commit, and deleted it here", rel, size / 1e6, self.repo_id)


class _Component:
    """Which saved tensors live in which output files, and which are finished, checked and uploaded."""

    def __init__(self, up: ShardUploader, name: str, folder: Path, digests: dict[str, str]) -> None:
        self.up, self.name, self.folder, self.digests = up, name, folder, digests
        self.files_of: dict[str, set[str]] = {}
        self.complete: set[str] = set()
        self.pending: dict[str, set[str]] = {}  # file -> tensors of it not yet checked

    def planned(self, files_of: dict[str, set[str]]) -> None:
        self.files_of = files_of
        for tensor, files in files_of.items():
            for f in files:
                self.pending.setdefault(f, set()).add(tensor)

    def finished(self, path: Path) -> None:
        """The engine's on_output_file: check what became complete, upload what is fully checked."""
        if path.suffix != ".safetensors" or path.name not in self.pending:
            return  # configs and the index stay local: they are committed with the card
        self.complete.add(path.name)
        waiting = [f for f in sorted(self.complete) if f in self.pending]  # finished, not yet uploaded
        ready = sorted({t for f in waiting for t in self.pending[f] if self.files_of[t] <= self.complete})
        if ready:
            self._check(ready)
        for f in waiting:
            if not self.pending[f]:
                del self.pending[f]
                self.up.upload(self.folder / f)

    def _check(self, names: list[str]) -> None:
        from publisher.streaming.shards import LocalShards
        from publisher.verify.streaming import check_tensors

        files = sorted({f for t in names for f in self.files_of[t]})
        wanted = {n: self.digests.get(n, "") for n in names}
        tc = check_tensors(LocalShards(self.folder, files), wanted, [], self.up.tensor_class, only=set(names))
        if not tc.ok:
            raise VerificationError(f"{self.name or 'model'}: {tc.detail} after writing; nothing was published")
        for name in names:
            for f in self.files_of[name]:
                self.pending[f].discard(name)
        self.up.checked[self.name] = self.up.checked.get(self.name, 0) + tc.checked
        self.up.classes[self.name] = self.up.classes.get(self.name, 0) + tc.of_class


def ensure_repo(repo_id: str, token: str | None, private: bool) -> bool:
    """The target must exist before shards are pre-uploaded; True when this run created it (and must
    delete it again if the run fails)."""

    api = hub.client(token)
    if hub.call(api.repo_exists, repo_id, what=f"checking {repo_id}"):
        return False
    hub.call(api.create_repo, repo_id, private=private, exist_ok=True, what=f"creating {repo_id}")
    return True


def discard(repo_id: str, token: str | None, created: bool) -> None:
    """After a failure: a repo this run created goes again; pre-uploaded shards of an existing repo are
    unreferenced LFS objects that no commit ever points to."""
    if created:
        hub.delete_repo_quietly(repo_id, token)


def push_staged(folder: Path, report: VerifyReport, uploader: ShardUploader, *, token: str | None, create_pr: bool,
                message: str, description: str, created: bool, check: Callable[[str], list[Path]]) -> PushResult:
    """Commit the pre-uploaded shards and the local files as a pull request, run ``check(pr_commit)`` on it
    (it raises on failure and returns the files it rewrote: card, report), commit those to the PR, and merge
    it unless ``create_pr``. Main never holds unchecked bytes; on failure the PR is closed."""
    from huggingface_hub import CommitOperationAdd

    from publisher.stages.push import PushResult, commit_operations, published_state

    api, repo_id = uploader.api, uploader.repo_id
    if not report.passed:
        raise VerificationError(f"refusing to push {repo_id}: verification failed ({report.summary()})")
    head, _ = published_state(repo_id, token)
    _, ops = commit_operations(api, repo_id, folder, head, list(uploader.ops.values()))
    pr_num: int | None = None
    try:
        info = hub.call(api.create_commit, repo_id, ops, commit_message=f"hf-ao-publish: {message}",
                          commit_description=description, create_pr=True, what=f"opening a pull request on {repo_id}")
        pr_num, pr_ref = info.pr_num, info.pr_revision
        log.info("committed to %s as pull request #%s; checking it before it is merged", repo_id, pr_num)
        rewritten = check(info.oid)
        update = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p)) for p in rewritten]
        hub.call(api.create_commit, repo_id, update, commit_message="hf-ao-publish: verification results",
                   revision=pr_ref, parent_commit=info.oid, what=f"updating pull request #{pr_num} on {repo_id}")
        pr_url = hub.pr_url(repo_id, pr_num)
        if create_pr:
            oid = hub.call(api.repo_info, repo_id, revision=pr_ref, what=f"reading {repo_id}").sha
            return PushResult(repo_id, hub.repo_url(repo_id), oid, pr_url, False, created)
        hub.call(api.merge_pull_request, repo_id, pr_num, comment="Checked by hf-ao-publish before merging.",
                   what=f"merging pull request #{pr_num} on {repo_id}")
        oid = hub.call(api.repo_info, repo_id, what=f"reading {repo_id}").sha
    except BaseException:
        if pr_num is not None:
            try:
                api.change_discussion_status(repo_id, pr_num, "closed", comment="Closed by hf-ao-publish: the check failed.")
            except Exception as exc:  # the original error matters more; this one is only reported
                log.warning("could not close pull request #%s on %s: %s", pr_num, repo_id, hub.short(exc))
        discard(repo_id, token, created)
        raise
    return PushResult(repo_id, hub.repo_url(repo_id), oid, None, False, created)
