"""Stage 6: publish a verified folder to the Hub in one commit.

`push` takes the verification report as an argument and refuses a failed one, so an unverified
push cannot be written. The repo is created only now; if the upload or the commit then fails, a repo
we created is deleted again so the target is left exactly as it was.

Every Hub call is retried on transient errors (publisher.io.hub). A commit is not idempotent: before
it is sent again, the target head is re-read, and a head that moved to a commit carrying this run's
fingerprint in its state file means the earlier try landed (only its answer was lost).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from publisher import __version__
from publisher.errors import InputError, TargetError, VerificationError
from publisher.handoffs.plan import Source
from publisher.handoffs.report import VerifyReport
from publisher.handoffs.statefile import STATE_FILE
from publisher.io import hub
from publisher.io.jsonfile import read_object
from publisher.io.tokens import TokenRights
from publisher.verify.commit_hashes import CommitFile, check_uploaded, of_file

if TYPE_CHECKING:
    from huggingface_hub import HfApi

log = logging.getLogger(__name__)

GITATTRIBUTES = ("*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.png filter=lfs diff=lfs merge=lfs -text\n"
                 "*.jpg filter=lfs diff=lfs merge=lfs -text\n")


def write_repo_files(folder: Path, state: dict[str, Any]) -> None:
    """The files every published repo carries besides weights and card: .gitattributes (weights and images in LFS)
    and the state file (what produced the repo, for the next run's "nothing changed")."""
    (folder / ".gitattributes").write_text(GITATTRIBUTES)
    (folder / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")

@dataclass
class PushResult:
    repo_id: str
    url: str
    commit: str | None
    pr_url: str | None
    up_to_date: bool
    created: bool
    files: dict[str, CommitFile] = field(default_factory=dict)  # what the commit must hold: hashes taken before upload


def published_state(repo_id: str, token: str | None, revision: str | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """(head sha, the state file at that sha) of the target, or (None, None) when it does not exist.

    Transient Hub errors are retried; a Hub that stays unreachable raises (it is never taken for
    "no state file", which would make an unchanged re-run publish again)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    api = hub.client(token)
    try:
        info = hub.call(api.repo_info, repo_id, revision=revision, what=f"reading {repo_id}")
    except (RevisionNotFoundError, RepositoryNotFoundError):
        return None, None
    return info.sha, _state_at(repo_id, info.sha, token)


def _state_at(repo_id: str, sha: str | None, token: str | None, *, retried: bool = True) -> dict[str, Any] | None:
    """The state file of the target at `sha`, None when there is none (or it is not JSON)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError

    if sha is None:
        return None
    try:
        if retried:
            path = hub.call(hf_hub_download, repo_id, STATE_FILE, revision=sha, token=token,
                              what=f"reading {STATE_FILE} of {repo_id}")
        else:
            path = hf_hub_download(repo_id, STATE_FILE, revision=sha, token=token)
    except RemoteEntryNotFoundError:
        return None
    except LocalEntryNotFoundError as exc:
        if exc.__cause__ is not None and hub.is_transient(exc.__cause__):
            raise exc.__cause__ from None  # the Hub could not be reached: say so, not "no state file"
        return None
    try:
        return read_object(Path(path), f"{repo_id}/{STATE_FILE}")
    except InputError:  # not our state file after all: publish as over a repo without one
        return None


def up_to_date(repo_id: str, token: str | None, fingerprint: str, *, create_pr: bool,
               force: bool) -> tuple[PushResult | None, dict[str, Any] | None]:
    """Before any download: (what a push would report when it would change nothing, else None; the target's state
    file, for the commit description). With ``create_pr`` the state that counts is our open PR's, when there is one."""
    pr = find_open_pr(repo_id, token) if create_pr else None
    head, previous = published_state(repo_id, token, pr[1] if pr else None)
    if not ((pr or not create_pr) and previous and previous.get("fingerprint") == fingerprint):
        return None, previous
    if force:
        log.info("%s is up to date; publishing it again (--force)", repo_id)
        return None, previous
    url = f"{hub.endpoint()}/{repo_id}"
    return PushResult(repo_id, url, head, f"{url}/discussions/{pr[0]}" if pr else None, True, False), previous


def find_open_pr(repo_id: str, token: str | None, title_prefix: str = "hf-ao-publish:") -> tuple[int, str] | None:
    """Our open pull request on the target, if a previous --create-pr run opened one (or, with ``title_prefix``, a
    previous run of another command: `recheck`'s)."""
    from huggingface_hub.errors import RepositoryNotFoundError

    api = hub.client(token)
    try:
        discussions = hub.call(
            lambda: list(api.get_repo_discussions(repo_id, discussion_type="pull_request", discussion_status="open")),
            what=f"listing the pull requests of {repo_id}",
        )
    except RepositoryNotFoundError:
        return None  # a new target: no PR yet
    for disc in discussions:
        if disc.title.startswith(title_prefix):
            return disc.num, disc.git_reference or f"refs/pr/{disc.num}"
    return None


def push(
    folder: Path,
    report: VerifyReport,
    *,
    repo_id: str,
    token: str | None,
    private: bool,
    create_pr: bool,
    message: str,
    description: str,
    state: dict[str, Any],
    force: bool = False,
) -> PushResult:
    if not report.passed:
        raise VerificationError(f"refusing to push {repo_id}: verification failed ({report.summary()})")
    api = hub.client(token)
    if json.loads((folder / STATE_FILE).read_text()).get("fingerprint") != state["fingerprint"]:
        raise VerificationError(f"refusing to push {repo_id}: {folder} was not produced by this run")

    def exists() -> bool:
        return hub.call(api.repo_exists, repo_id, what=f"checking {repo_id}")

    pr = find_open_pr(repo_id, token) if create_pr and exists() else None
    revision = pr[1] if pr else None
    head, previous = published_state(repo_id, token, revision)
    if previous is not None and previous.get("fingerprint") == state["fingerprint"] and not force:
        return PushResult(repo_id, hub.repo_url(repo_id), head, _pr_url(repo_id, pr), True, False)

    created = head is None and not exists()
    repo_url = hub.call(api.create_repo, repo_id, private=private, exist_ok=True, what=f"creating {repo_id}")
    try:
        additions, ops = commit_operations(api, repo_id, folder, head)
        ours = {op.path_in_repo: of_file(Path(op.path_or_fileobj)) for op in additions}  # the verified files' bytes
        log.info("uploading %d files (%.1f MB) to %s, then committing them", len(additions),
                 sum(f.size for f in ours.values()) / 1e6, repo_id)
        # LFS uploads first, on their own: a retried commit then re-sends only the commit, not the weights.
        hub.call(api.preupload_lfs_files, repo_id, additions=additions, revision=revision,
                   create_pr=create_pr and not pr, free_memory=False, what=f"uploading the weights to {repo_id}")
        for op in additions:
            check_uploaded(op, ours[op.path_in_repo], repo_id)

        def landed() -> tuple[str, str | None] | None:
            """Before re-sending a commit: did the previous try land although its answer was lost?
            Yes when the target moved and its state file carries this run's fingerprint."""
            target: tuple[int, str] | None = pr
            if create_pr and not pr:
                target = find_open_pr(repo_id, token)
                if target is None:
                    return None
            now = api.repo_info(repo_id, revision=target[1] if target else None).sha
            if now == head or (_state_at(repo_id, now, token, retried=False) or {}).get("fingerprint") != state["fingerprint"]:
                return None
            return (now, _pr_url(repo_id, target)) if now else None

        if pr:
            commit = lambda: api.create_commit(  # noqa: E731
                repo_id, ops, commit_message=message, commit_description=description, revision=pr[1],
                parent_commit=head)
        else:
            commit = lambda: api.create_commit(  # noqa: E731
                repo_id, ops, commit_message=message if not create_pr else f"hf-ao-publish: {message}",
                commit_description=description, create_pr=create_pr, parent_commit=None if create_pr else head)

        def send() -> tuple[str, str | None]:
            info = commit()
            return info.oid, _pr_url(repo_id, pr) if pr else info.pr_url

        oid, pr_url = hub.call(send, what=f"committing to {repo_id}", check=landed)
    except BaseException:
        if created:
            hub.delete_repo_quietly(repo_id, token)
        raise
    if head is not None and oid == head:  # --force over identical files: the client sends no empty commit
        log.info("%s: every file is the same as in its commit %s, so the Hub made no new commit", repo_id, head[:12])
        return PushResult(repo_id, str(repo_url), head, pr_url, True, False)
    # hashed here from the verified files, and equal to what the uploader read (check_uploaded)
    return PushResult(repo_id, str(repo_url), oid, pr_url, False, created, ours)


def commit_operations(api: HfApi, repo_id: str, folder: Path, head: str | None,
                      uploaded: list[Any] = ()) -> tuple[list[Any], list[Any]]:  # type: ignore[assignment]
    """(additions from ``folder``, every operation of the commit): ``uploaded`` adds already pre-uploaded files;
    a republish replaces the previous content, so files we no longer produce are deleted in the same commit."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    additions = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
                 for p in sorted(folder.rglob("*")) if p.is_file()]
    ops: list[Any] = [*uploaded, *additions]
    if head is not None:
        ours = {op.path_in_repo for op in ops}
        old = hub.call(api.list_repo_files, repo_id, revision=head, what=f"listing the files of {repo_id}")
        ops += [CommitOperationDelete(path_in_repo=f) for f in old if f not in ours and f != ".gitattributes"]
    return additions, ops


def _pr_url(repo_id: str, pr: tuple[int, str] | None) -> str | None:
    return hub.pr_url(repo_id, pr[0] if pr else None)


def check_writable(repo_id: str, token: str, who: dict[str, Any] | None = None) -> None:
    """Preflight: the token is valid and may create or write the target (its namespace membership and, for a
    read-only or fine-grained token, its permissions). ``who``: whoami-v2's answer, when already read. A push without
    a token is refused before the base is read (stages/planning.make_plan)."""
    api = hub.client(token)
    who = who if who is not None else hub.call(api.whoami, what="checking the token")
    namespace = repo_id.split("/")[0]
    orgs = {o.get("name") for o in who.get("orgs", [])}
    if namespace != who.get("name") and namespace not in orgs:
        raise TargetError(
            f"the token of {who.get('name')} cannot write to the namespace {namespace!r} of {repo_id}; "
            f"use --repo-id {who.get('name')}/... or a token of a member of {namespace}"
        )
    rights = TokenRights.of(who)
    # Creating a repo takes repo.write on its namespace; an existing repo also takes it granted on the repo alone.
    reason = rights.require("repo.write", namespace, f"create {repo_id}")
    if reason is not None and not (rights.allows("repo.write", repo_id)
                                   and hub.call(api.repo_exists, repo_id, what=f"checking {repo_id}")):
        raise TargetError(reason)


def commit_text(source: Source, recipe: str, previous: dict[str, Any] | None, state: dict[str, Any], *,
                forced: bool) -> tuple[str, str]:
    """(message, description) of the commit that publishes ``recipe``: the pinned base, and what changed."""
    message = f"Quantize {source.name}@{(source.sha or 'local')[:12]} with torchao {recipe}"
    return message, changes(previous, state, forced=forced) + f"\n\nMade with hf-ao-publish {__version__}."


def changes(previous: dict[str, Any] | None, state: dict[str, Any], *, forced: bool = False) -> str:
    """The commit description: what changed since the target's previous state file (for a re-run's commit)."""
    if not previous:
        return "First publication."
    changed = [k for k in state if k not in ("fingerprint", "base_files") and previous.get(k) != state.get(k)]
    if not changed and forced:
        return "Published again with --force: the base, recipe, options and versions are those of the previous publication."
    return "Changed since the previous publication: " + (", ".join(changed) or "unknown") + "."
