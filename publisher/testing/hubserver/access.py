"""The loopback Hub's state and access rules, shared by the read and write endpoints and the router.

The endpoint mixins (reads.py, writes.py) derive from ``HubAccess``, and the router (app.py) from both, so the
modules import in one direction only: access <- reads, writes <- app.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from publisher.testing.hubserver.faults import FaultInjector
from publisher.testing.hubserver.storage import HubError, Store, validate_repo_id
from publisher.testing.hubserver.wire import Request

URL_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


class HubAccess:
    def __init__(self, store: Store, tokens: Mapping[str, str] | None = None,
                 orgs: Mapping[str, Any] | None = None, gated: Mapping[str, Any] | None = None) -> None:
        self.store = store
        self.tokens = dict(tokens or {})  # token -> user name
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
        return self.tokens[token]

    def orgs_of(self, user: str) -> list[str]:
        return sorted(org for org, members in self.orgs.items() if user in members)

    def is_member(self, user: str | None, namespace: str) -> bool:
        return user is not None and (user == namespace or user in self.orgs.get(namespace, ()))

    def readable_repo(self, repo_type: str, repo_id: str, user: str | None) -> dict:
        """The repo's metadata, or 404 RepoNotFound if it is missing or private to someone else."""
        validate_repo_id(repo_id)
        meta = self.store.get_repo(repo_type, repo_id)
        if meta is None or (meta["private"] and not self.is_member(user, repo_id.split("/")[0])):
            raise HubError(404, f"Repository Not Found for {repo_type} {repo_id}", "RepoNotFound")
        return meta

    def require_writer(self, user: str | None, namespace: str, what: str) -> None:
        if user is None:
            raise HubError(401, f"You must be authenticated to {what} (no token sent)")
        if not self.is_member(user, namespace):
            raise HubError(403, f"You don't have the rights to {what}: user '{user}' is neither "
                                f"'{namespace}' nor a member of the '{namespace}' organization")

    def check_gate(self, meta: dict, user: str | None) -> None:
        if meta.get("gated") and not (self.is_member(user, meta["id"].split("/")[0])
                                      or (user is not None and user in meta.get("granted", []))):
            who = f"user '{user}' is" if user else "anonymous requests are"
            raise HubError(403, f"Access to {meta['type']} {meta['id']} is restricted and {who} not in the "
                                "authorized list. Visit the repo page to ask for access.", "GatedRepo")

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
