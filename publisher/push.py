"""Stage 6: publish a verified folder to the Hub in one commit.

`push` takes the verification report as an argument and refuses a failed one, so an unverified
push cannot be written. The repo is created only now; if the commit then fails, a repo we created
is deleted again so the target is left exactly as it was.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import TargetError, VerificationError
from .verify import VerifyReport

log = logging.getLogger(__name__)

STATE_FILE = "hf_ao_publish.json"  # what produced the repo; lets a re-run detect "nothing changed"


@dataclass
class PushResult:
    repo_id: str
    url: str
    commit: str | None
    pr_url: str | None
    up_to_date: bool
    created: bool


def published_state(repo_id: str, token: str | None, revision: str | None = None) -> tuple[str | None, dict[str, Any] | None]:
    """(head sha, the state file at that sha) of the target, or (None, None) when it does not exist."""
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(token=token)
    try:
        info = api.repo_info(repo_id, revision=revision)
    except RevisionNotFoundError:
        return None, None
    except RepositoryNotFoundError:
        return None, None
    try:
        path = hf_hub_download(repo_id, STATE_FILE, revision=info.sha, token=token)
    except EntryNotFoundError:
        return info.sha, None
    try:
        return info.sha, json.loads(Path(path).read_text())
    except ValueError:
        return info.sha, None


def find_open_pr(repo_id: str, token: str | None) -> tuple[int, str] | None:
    """Our open pull request on the target, if a previous --create-pr run opened one."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    for disc in api.get_repo_discussions(repo_id, discussion_type="pull_request", discussion_status="open"):
        if disc.title.startswith("hf-ao-publish:"):
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
) -> PushResult:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    if not report.passed:
        raise VerificationError(f"refusing to push {repo_id}: verification failed ({report.summary()})")
    api = HfApi(token=token)
    if json.loads((folder / STATE_FILE).read_text()).get("fingerprint") != state["fingerprint"]:
        raise VerificationError(f"refusing to push {repo_id}: {folder} was not produced by this run")

    pr = find_open_pr(repo_id, token) if create_pr and api.repo_exists(repo_id) else None
    revision = pr[1] if pr else None
    head, previous = published_state(repo_id, token, revision)
    if previous is not None and previous.get("fingerprint") == state["fingerprint"]:
        return PushResult(repo_id, _url(api, repo_id), head, _pr_url(api, repo_id, pr), True, False)

    created = head is None and not api.repo_exists(repo_id)
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    ops: list[Any] = [
        CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    ]
    ours = {op.path_in_repo for op in ops}
    if head is not None:
        # A republish replaces the previous content: files we no longer produce are deleted in the same commit.
        old = api.list_repo_files(repo_id, revision=head)
        ops += [CommitOperationDelete(path_in_repo=f) for f in old if f not in ours and f != ".gitattributes"]
    try:
        if pr:
            info = api.create_commit(repo_id, ops, commit_message=message, commit_description=description,
                                     revision=pr[1], parent_commit=head)
            pr_url = _pr_url(api, repo_id, pr)
        else:
            info = api.create_commit(
                repo_id, ops, commit_message=message if not create_pr else f"hf-ao-publish: {message}",
                commit_description=description, create_pr=create_pr,
                parent_commit=None if create_pr else head,
            )
            pr_url = info.pr_url
    except BaseException:
        if created:
            _delete_quietly(api, repo_id)
        raise
    return PushResult(repo_id, str(repo_url), info.oid, pr_url, False, created)


def _delete_quietly(api: Any, repo_id: str) -> None:
    """Best effort: remove the empty repo we just created so a failed push leaves nothing behind."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        api.delete_repo(repo_id)
        log.info("deleted the empty repo %s after the failed commit", repo_id)
    except (HfHubHTTPError, OSError) as exc:
        log.warning("could not delete the empty repo %s after the failed commit: %s", repo_id, exc)


def _url(api: Any, repo_id: str) -> str:
    return f"{api.endpoint.rstrip('/')}/{repo_id}"


def _pr_url(api: Any, repo_id: str, pr: tuple[int, str] | None) -> str | None:
    return f"{_url(api, repo_id)}/discussions/{pr[0]}" if pr else None


def check_writable(repo_id: str, token: str | None) -> str:
    """Preflight: the token is valid and can write to the target namespace. Returns the user name."""
    from huggingface_hub import HfApi

    if not token:
        raise TargetError("pushing needs a Hub token with write access; set HF_TOKEN (or pass --token), or use --no-push")
    who = HfApi(token=token).whoami()
    namespace = repo_id.split("/")[0]
    orgs = {o.get("name") for o in who.get("orgs", [])}
    if namespace != who.get("name") and namespace not in orgs:
        raise TargetError(
            f"the token of {who.get('name')} cannot write to the namespace {namespace!r} of {repo_id}; "
            f"use --repo-id {who.get('name')}/... or a token of a member of {namespace}"
        )
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise TargetError("the Hub token is read-only; create a token with write access and set HF_TOKEN")
    return str(who.get("name"))
