"""--low-disk with a push: output shards leave the disk as soon as they are finished and checked.

Each finished safetensors shard of a streamed component is checked tensor by tensor against the
digests the engine recorded in memory (torchao's own unflatten, the recipe's class, bit for bit), hashed
(sha256: the LFS oid the Hub must then report for it), pre-uploaded to the target repo's storage
(``HfApi.preupload_lfs_files``: no commit; through Xet by default, whose own sha256 of the bytes it read must be the
same) and deleted. That happens on a thread of its own (the shipper), so
the upload of shard k overlaps the quantization of what follows; the disk budget (``reserve``) makes the engine's
writer wait when the shard being shipped plus what has been written since would exceed one shard plus
``OVERLAP``. A tensor whose parts span two shards is checked when its last shard is finished; the earlier shard
waits for it (and does not count as shipping). The files the run does not change go from the base repo to the
target on another thread (``hubcopy.HubCopy``), never to disk.

Nothing is visible on the repo's main branch until the end: ``push_staged`` commits everything (these
pre-uploaded files plus the local ones) as a pull request, checks that the Hub reports for every file of it the
hashes taken here, runs what verification still needs the pushed commit for (only when the forward pass could not
run during quantization), and merges it only when that passes. The repo must exist before the first pre-upload:
one created by this run is deleted again if the run fails.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher.errors import VerificationError
from publisher.io import hub
from publisher.request import size_bytes
from publisher.stages.hubcopy import HubCopy, base_hashes, unchanged_files
from publisher.stages.push import PushResult, commit_operations, published_state
from publisher.streaming.shards import LocalShards
from publisher.verify.commit_hashes import CommitFile, check_commit, check_uploaded, of_file, of_operation
from publisher.verify.streaming import check_tensors

if TYPE_CHECKING:
    from publisher.handoffs.plan import Plan
    from publisher.handoffs.report import VerifyReport
    from publisher.stages.hubcopy import HubCopy
    from publisher.stages.push import PushResult

log = logging.getLogger(__name__)

OVERLAP = 512 * 1024 * 1024  # bytes of later output the engine may write while a finished shard is being shipped
# The default output shard size when shards leave the disk as they are made: the disk peak is about one shard plus
# OVERLAP, so FLUX.1-dev (a 12 GB int8 transformer; diffusers' default shard is 10 GB) needs about 2.5 GB of disk.
LOW_DISK_SHARD = "2GB"


class ShardUploader:
    """One target repo; ``for_component`` gives the engine's output sink (streaming.OutputSink) for one streamed
    component."""

    def __init__(self, repo_id: str, token: str | None, root: Path, tensor_class: str | tuple[str, ...], shard_bytes: int) -> None:
        self.api, self.repo_id, self.root, self.tensor_class = hub.client(token), repo_id, root, tensor_class
        self.token = token
        self.ops: dict[str, Any] = {}  # path in repo -> pre-uploaded CommitOperationAdd
        self.sizes: dict[str, int] = {}  # path in repo -> bytes (the local file is gone)
        self.expected: dict[str, CommitFile] = {}  # path in repo -> hashes taken here (what the Hub must report)
        self.checked: dict[str, int] = {}  # component -> tensors checked before upload
        self.classes: dict[str, int] = {}  # component -> quantized layers of the recipe's class
        self.limit = shard_bytes + OVERLAP
        self.seconds = {"check": 0.0, "hash": 0.0, "upload": 0.0}
        self.copy: HubCopy | None = None
        self._cond = threading.Condition()
        self._on_disk: dict[Path, int] = {}  # output shards written, in part or whole, and not yet deleted
        self._shipping: dict[Path, int] = {}  # finished shards the shipper is about to upload (and delete)
        self._jobs: queue.Queue[tuple[_Component, Path] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def for_component(self, name: str, folder: Path) -> _Component:
        return _Component(self, name, folder)

    def uploaded_bytes(self, folder: Path) -> int:
        prefix = folder.relative_to(self.root).as_posix()
        prefix = "" if prefix == "." else prefix + "/"
        return sum(size for rel, size in self.sizes.items() if rel.startswith(prefix) and "/" not in rel[len(prefix):])

    # ---- the disk budget (called on the engine's writer thread)
    def reserve(self, path: Path, nbytes: int) -> None:
        """Wait while a finished shard is being shipped and writing ``nbytes`` more would exceed the budget."""
        with self._cond:
            while (self._error is None and self._shipping
                   and sum(self._on_disk.values()) + nbytes > self.limit):
                self._cond.wait(0.5)
            if self._error is not None:
                raise self._error
            self._on_disk[path] = self._on_disk.get(path, 0) + nbytes

    # ---- the shipper thread
    def _submit(self, comp: _Component, path: Path) -> None:
        with self._cond:
            if self._error is not None:
                raise self._error
            self._shipping[path] = path.stat().st_size
            self._on_disk[path] = path.stat().st_size
        if self._thread is None:
            self._thread = threading.Thread(target=self._ship, name="hf-ao-publish-shipper", daemon=True)
            self._thread.start()
        self._jobs.put((comp, path))

    def _ship(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._error is None:
                    job[0].finished(job[1])
            except BaseException as exc:  # raised again on the writer thread (reserve) or by flush()
                with self._cond:
                    self._error = exc
            finally:
                if job is not None:
                    with self._cond:
                        self._shipping.pop(job[1], None)  # uploaded, or waiting for a later shard
                        self._cond.notify_all()
                self._jobs.task_done()

    def flush(self) -> None:
        """Wait until every finished shard is checked and uploaded; raise what went wrong on the way."""
        self._jobs.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the shipper and the copy from the base (after a failure, or at the end)."""
        with self._cond:
            if self._error is None:
                self._error = VerificationError("the run stopped")
            self._cond.notify_all()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if self.copy is not None:
            self.copy.cancel()

    def upload(self, path: Path) -> None:
        """(shipper thread) Hash one checked shard, pre-upload it, then delete it (LFS files only: a regular file is
        read again at commit)."""
        from huggingface_hub import CommitOperationAdd

        rel = path.relative_to(self.root).as_posix()
        t0 = time.perf_counter()
        hashes = of_file(path)
        t1 = time.perf_counter()
        # No preset sha256: the uploader hashes what it reads (hf_xet while chunking), and that must be ours.
        op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path))
        hub.call(self.api.preupload_lfs_files, self.repo_id, additions=[op], free_memory=False,
                 what=f"uploading {rel} to {self.repo_id}")
        check_uploaded(op, hashes, self.repo_id)
        self.seconds["hash"] += t1 - t0
        self.seconds["upload"] += time.perf_counter() - t1
        size = path.stat().st_size
        self.expected[rel] = hashes
        if not (op._upload_mode == "lfs" and op._is_uploaded):  # the Hub takes it as a regular file: at the commit
            log.info("%s (%.1f MB) stays on disk until the commit (not an LFS file for %s)", rel, size / 1e6, self.repo_id)
            return
        path.unlink()
        with self._cond:
            self._on_disk.pop(path, None)
            self._cond.notify_all()
        self.ops[rel], self.sizes[rel] = op, size
        log.info("uploaded %s (%.1f MB) to %s before the commit, and deleted it here", rel, size / 1e6, self.repo_id)

    # ---- the files the run does not change
    def start_copy(self, copy: HubCopy, after: HubCopy | None = None) -> None:
        self.copy = copy.start(after)

    def finish_copy(self) -> list[dict[str, Any]]:
        """Wait for the copy from the base; its files join the commit. Returns what was copied (for --json)."""
        if self.copy is None:
            return []
        for op in self.copy.wait():
            self.ops[op.path_in_repo] = op
        for path, hashes in self.copy.expected.items():
            self.expected[path], self.sizes[path] = hashes, hashes.size
        return [asdict(c) for c in self.copy.copied]


class _Component:
    """The engine's output sink for one component (streaming.OutputSink): which saved tensors live in which output
    files, and which are finished, checked and uploaded."""

    def __init__(self, up: ShardUploader, name: str, folder: Path) -> None:
        self.up, self.name, self.folder = up, name, folder
        self.digests: Mapping[str, str] = {}  # the engine's, filled as it writes
        self.files_of: dict[str, set[str]] = {}
        self.complete: set[str] = set()
        self.pending: dict[str, set[str]] = {}  # file -> tensors of it not yet checked

    def planned(self, files_of: dict[str, set[str]], digests: Mapping[str, str]) -> None:
        self.files_of, self.digests = files_of, digests
        for tensor, files in files_of.items():
            for f in files:
                self.pending.setdefault(f, set()).add(tensor)

    def reserve(self, path: Path, nbytes: int) -> None:
        """(writer thread) The disk budget of the whole uploader."""
        self.up.reserve(path, nbytes)

    def written(self, path: Path) -> None:
        """(writer thread) A finished output file: a shard goes to the shipper."""
        if path.suffix != ".safetensors" or path.name not in self.pending:
            return  # configs and the index stay local: they are committed with the card
        self.up._submit(self, path)

    def finished(self, path: Path) -> None:
        """(shipper thread) Check what became complete, upload what is fully checked."""
        self.complete.add(path.name)
        waiting = [f for f in sorted(self.complete) if f in self.pending]  # finished, not yet uploaded
        ready = sorted({t for f in waiting for t in self.pending[f] if self.files_of[t] <= self.complete})
        if ready:
            t0 = time.perf_counter()
            self._check(ready)
            self.up.seconds["check"] += time.perf_counter() - t0
        for f in waiting:
            if not self.pending[f]:
                del self.pending[f]
                self.up.upload(self.folder / f)

    def _check(self, names: list[str]) -> None:
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


def staging(plan: Plan, staged: bool, max_shard_size: str | None) -> tuple[int | None, frozenset[str]]:
    """(output shard size in bytes, or None for the library's default; the unchanged base files that go from the base
    repo to the target without touching the disk). ``staged``: output shards leave the disk as they are made."""

    shard = size_bytes(max_shard_size or LOW_DISK_SHARD) if max_shard_size or staged else None
    return shard, frozenset(unchanged_files(plan)) if staged and plan.source.repo_id else frozenset()


def open_uploader(plan: Plan, target: str, token: str | None, private: bool, root: Path, tensor_class: str | tuple[str, ...],
                  shard_size: int | None, unchanged: frozenset[str], after: HubCopy | None = None) -> tuple[ShardUploader, bool]:
    """The uploader of one recipe's target (created if needed: True then), with the copy of ``unchanged`` base files
    from the base repo to the target already under way (``after``: once that copy, another recipe's, is done)."""

    created = ensure_repo(target, token, private)
    uploader = ShardUploader(target, token, root, tensor_class, shard_size or size_bytes(LOW_DISK_SHARD))
    try:
        if unchanged:
            uploader.start_copy(HubCopy(plan, target, token, base_hashes(plan, sorted(unchanged))), after)
    except BaseException:
        discard(target, token, created)
        raise
    return uploader, created


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
    """Commit the pre-uploaded files and the local ones as a pull request; check that the Hub reports for every file
    of it the hashes taken here, run ``check(pr_commit)`` (what verification still needs the pushed commit for; it
    raises on failure and returns the files it rewrote, committed to the PR), and merge it unless ``create_pr``.
    Main never holds unchecked bytes; on failure the PR is closed. ``PushResult.files``: what the merged commit
    must hold."""
    from huggingface_hub import CommitOperationAdd


    api, repo_id = uploader.api, uploader.repo_id
    if not report.passed:
        raise VerificationError(f"refusing to push {repo_id}: verification failed ({report.summary()})")
    head, _ = published_state(repo_id, token)
    additions, ops = commit_operations(api, repo_id, folder, head, list(uploader.ops.values()))
    expected = {**uploader.expected, **{op.path_in_repo: of_operation(op) for op in additions}}  # before any upload
    pr_num: int | None = None
    try:
        info = hub.call(api.create_commit, repo_id, ops, commit_message=f"hf-ao-publish: {message}",
                        commit_description=description, create_pr=True, what=f"opening a pull request on {repo_id}")
        pr_num, pr_ref = info.pr_num, info.pr_revision
        log.info("committed to %s as pull request #%s; checking it before it is merged", repo_id, pr_num)
        _require_hashes(repo_id, info.oid, expected, token, f"pull request #{pr_num}")
        rewritten = check(info.oid)
        if rewritten:
            update = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p)) for p in rewritten]
            expected.update({op.path_in_repo: of_operation(op) for op in update})
            hub.call(api.create_commit, repo_id, update, commit_message="hf-ao-publish: verification results",
                     revision=pr_ref, parent_commit=info.oid, what=f"updating pull request #{pr_num} on {repo_id}")
        pr_url = hub.pr_url(repo_id, pr_num)
        if create_pr:
            oid = hub.call(api.repo_info, repo_id, revision=pr_ref, what=f"reading {repo_id}").sha
            return PushResult(repo_id, hub.repo_url(repo_id), oid, pr_url, False, created, expected)
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
    return PushResult(repo_id, hub.repo_url(repo_id), oid, None, False, created, expected)


def _require_hashes(repo_id: str, revision: str, expected: dict[str, CommitFile], token: str | None, where: str) -> None:
    result = check_commit(repo_id, revision, expected, token)
    if not result.ok:
        raise VerificationError(f"{where} on {repo_id} does not hold the verified bytes: {result.detail}; "
                                "it was closed and nothing was merged")
    log.info("%s on %s: %s", where, repo_id, result.detail)
