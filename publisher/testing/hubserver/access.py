"""The loopback Hub's state and access rules, shared by the read and write endpoints and the router.

The endpoint mixins (reads.py, lfs.py, writes.py) derive from ``HubAccess``, and the router (app.py) from them, so
the modules import in one direction only: access <- reads, lfs <- writes <- app.

Tokens have a role, as on huggingface.co: ``write`` (the default), ``read``, or ``fineGrained`` with scoped
permissions (``{"global": [...], "scoped": [{"entity": {"type": "user"|"org"|"model"|..., "name": ...},
"permissions": ["repo.content.read", "repo.write", "job.write", ...]}], "canReadGatedRepos": bool}``). Each
endpoint asks for the permission the Hub asks for (reading a private repo's files: ``repo.content.read``; writing
or creating repos: ``repo.write``; Jobs: ``job.write``) on the repo or its namespace, and answers 403 naming it.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from publisher.testing.hubserver.faults import FaultInjector
from publisher.testing.hubserver.storage import HubError, Store, validate_repo_id
from publisher.testing.hubserver.wire import Request
from publisher.testing.hubserver.xet import XetStore

READ_PERMISSIONS = frozenset({"repo.content.read"})

URL_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


class HubAccess:
    def __init__(self, store: Store, tokens: Mapping[str, str] | None = None,
                 orgs: Mapping[str, Any] | None = None, gated: Mapping[str, Any] | None = None,
                 scopes: Mapping[str, Any] | None = None) -> None:
        self.store = store
        self.xet = XetStore(store.root / "xet")
        self.tokens = dict(tokens or {})  # token -> user name
        self.scopes = dict(scopes or {})  # token -> "read", or a fineGrained object; absent: a write token
        self.orgs = {org: list(users) for org, users in (orgs or {}).items()}  # org -> member names
        self.faults = FaultInjector()
        # (method, path, Range header) of recent requests: tests assert how files were read
        self.seen: collections.deque[tuple[str, str, str | None]] = collections.deque(maxlen=20000)
        # "repo_id" or "datasets/ns/name" -> granted users; applied now and again when the repo is created.
        self.gated_seed = {k: list(v or ()) for k, v in (gated or {}).items()}
        for key in self.gated_seed:
            self.apply_gated_seed(key)

    # ---- access rules ------------------------------------------------------------------------
    def authenticate(self, req: Request) -> str | None:
        header = req.headers.get("Authorization") or ""
        if not header:
            return None
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")  # Hub wording; the client keys on it
        req.token = token
        return self.tokens[token]

    def access_token(self, token: str | None) -> dict[str, Any]:
        """whoami-v2's ``auth.accessToken`` for a token."""
        scope = self.scopes.get(token or "", "write")
        if isinstance(scope, dict):
            return {"displayName": "hubserver", "role": "fineGrained", "fineGrained": scope}
        return {"displayName": "hubserver", "role": scope}

    def granted(self, req: Request, permission: str, repo_id: str) -> bool:
        """Whether the request's token holds ``permission`` on ``repo_id`` (or, for a bare name, that namespace)."""
        scope = self.scopes.get(req.token or "", "write")
        if scope == "write":
            return True
        if scope == "read":
            return permission in READ_PERMISSIONS
        namespace = repo_id.split("/")[0]
        held = set(scope.get("global") or ())
        for item in scope.get("scoped") or ():
            name = (item.get("entity") or {}).get("name")
            if name in (namespace, repo_id):
                held |= set(item.get("permissions") or ())
        return permission in held or (permission == "repo.content.read" and "repo.write" in held)

    def require_permission(self, req: Request, permission: str, repo_id: str) -> None:
        if not self.granted(req, permission, repo_id):
            raise HubError(403, f"This token has no '{permission}' permission on {repo_id}: edit the token's "
                                "permissions or use another token")

    def orgs_of(self, user: str) -> list[str]:
        return sorted(org for org, members in self.orgs.items() if user in members)

    def is_member(self, user: str | None, namespace: str) -> bool:
        return user is not None and (user == namespace or user in self.orgs.get(namespace, ()))

    def readable_repo(self, repo_type: str, repo_id: str, req: Request) -> dict:
        """The repo's metadata, or 404 RepoNotFound if it is missing or private to someone else (a private repo's
        members also need a token that may read its content)."""
        validate_repo_id(repo_id)
        meta = self.store.get_repo(repo_type, repo_id)
        if meta is None or (meta["private"] and not (self.is_member(req.user, repo_id.split("/")[0])
                                                     and self.granted(req, "repo.content.read", repo_id))):
            raise HubError(404, f"Repository Not Found for {repo_type} {repo_id}", "RepoNotFound")
        return meta

    def require_writer(self, req: Request, namespace: str, what: str, repo_id: str | None = None) -> None:
        """A member of ``namespace`` whose token may write there (or to ``repo_id``)."""
        user = req.user
        if user is None:
            raise HubError(401, f"You must be authenticated to {what} (no token sent)")
        if not self.is_member(user, namespace):
            raise HubError(403, f"You don't have the rights to {what}: user '{user}' is neither "
                                f"'{namespace}' nor a member of the '{namespace}' organization")
        self.require_permission(req, "repo.write", repo_id or namespace)

    def check_gate(self, meta: dict, req: Request) -> None:
        """Gated files: the namespace's members and granted users; anonymous reads get 401, as on the Hub."""
        user, scope = req.user, self.scopes.get(req.token or "", "write")
        if not meta.get("gated"):
            return
        if user is None:
            raise HubError(401, f"Access to {meta['type']} {meta['id']} is restricted. You must be authenticated "
                                "to access it.", "GatedRepo")
        if not (self.is_member(user, meta["id"].split("/")[0]) or user in meta.get("granted", [])):
            raise HubError(403, f"Access to {meta['type']} {meta['id']} is restricted and user '{user}' is not in "
                                "the authorized list. Visit the repo page to ask for access.", "GatedRepo")
        if isinstance(scope, dict) and not scope.get("canReadGatedRepos"):
            raise HubError(403, f"Access to {meta['type']} {meta['id']} is restricted: this fine-grained token may "
                                "not read gated repos (enable 'Read access to contents of all public gated repos "
                                "you can access')", "GatedRepo")

    def set_gated(self, repo_type: str, repo_id: str, gated: str | bool, granted: list[str]) -> dict:
        return self.store.update_repo(repo_type, repo_id, gated=gated or False, granted=list(granted))

    def apply_gated_seed(self, key: str) -> None:
        repo_type, repo_id = parse_type_prefixed(key)
        if self.store.get_repo(repo_type, repo_id) is not None:
            self.set_gated(repo_type, repo_id, "auto", self.gated_seed[key])

    def repo_url(self, req: Request, repo_type: str, repo_id: str) -> str:
        return f"{req.base_url}/{URL_PREFIX[repo_type]}{repo_id}"


def parse_type_prefixed(key: str) -> tuple[str, str]:
    """'ns/name' -> model; 'datasets/ns/name' / 'spaces/ns/name' -> that type (CLI and seed syntax)."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] in ("datasets", "spaces"):
        return URL_TYPES[parts[0]], "/".join(parts[1:])
    return "model", key
