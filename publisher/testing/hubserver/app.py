"""Request routing, authentication and access rules of the loopback Hub (transport-agnostic).

The HTTP plumbing (server.py) turns a socket request into a `Request` and writes back the `Response`;
everything Hub-specific lives here and in the reads/writes mixins, so it can be read without the
socket noise. Access rules follow huggingface.co where the client depends on them:
  * a bad token is 401 on every endpoint (the client maps it to a plain HfHubHTTPError);
  * a private repo is 404 RepoNotFound to non-members, so `repo_exists()` is False for them;
  * writing needs the user to be the namespace or a member of the org (403 otherwise, 401 if anonymous),
    except opening a PR, which any authenticated reader may do (as on the Hub);
  * gated repos list fine but their files answer 403 GatedRepo unless the user was granted.
"""

from __future__ import annotations

import collections

import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from publisher.testing.hubserver.faults import FaultInjector
from publisher.testing.hubserver.reads import ReadRoutes
from publisher.testing.hubserver.storage import REPO_TYPES, HubError, Store, validate_repo_id
from publisher.testing.hubserver.wire import Request, Response, error_response, json_response
from publisher.testing.hubserver.writes import WriteRoutes

_URL_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}


class HubApp(ReadRoutes, WriteRoutes):
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

    # ---- routing -----------------------------------------------------------------------------
    def handle(self, req: Request) -> Response:
        try:
            return self._route(req)
        except HubError as err:
            return error_response(err)

    def _route(self, req: Request) -> Response:
        parts = req.path.split("/")[1:]  # split BEFORE unquoting: a rev like refs%2Fpr%2F1 is one segment
        head = parts[0] if parts else ""
        if head == "_admin":
            return self.admin(req, parts[1:])
        if (fault := self.faults.take("delay", req.method, req.path)) is not None:
            time.sleep(fault.delay_s)
        if (fault := self.faults.take("status", req.method, req.path)) is not None:
            raise HubError(fault.status, f"Injected fault: HTTP {fault.status}")
        if head == "_lfs":
            return self.lfs_put(req, parts[1:])
        req.user = self.authenticate(req)
        if head == "api":
            return self.route_api(req, parts[1:])
        return self.route_git(req, parts)

    def route_api(self, req: Request, parts: list[str]) -> Response:
        m, n = req.method, len(parts)
        if parts == ["whoami-v2"] and m == "GET":
            return self.whoami(req)
        if parts == ["validate-yaml"] and m == "POST":
            return self.validate_yaml(req)
        if parts == ["repos", "create"] and m == "POST":
            return self.create_repo(req)
        if parts == ["repos", "delete"] and m == "DELETE":
            return self.delete_repo(req)
        if n == 1 and parts[0] in _URL_TYPES and m == "GET":
            return self.list_repos(req, _URL_TYPES[parts[0]])
        if n < 3 or parts[0] not in _URL_TYPES:
            raise HubError(404, f"Unknown API route /api/{'/'.join(parts)}")
        repo_type, repo_id = _URL_TYPES[parts[0]], f"{parts[1]}/{parts[2]}"
        action, rest = (parts[3] if n > 3 else ""), parts[4:]
        key = (m, action)
        if key == ("GET", "") or (key == ("GET", "revision") and len(rest) == 1):
            return self.repo_info(req, repo_type, repo_id, unquote(rest[0]) if rest else "main")
        if key == ("GET", "tree") and rest:
            return self.tree(req, repo_type, repo_id, unquote(rest[0]), unquote("/".join(rest[1:])))
        if key == ("GET", "refs"):
            return self.refs(req, repo_type, repo_id)
        if key == ("GET", "commits") and len(rest) == 1:
            return self.commits(req, repo_type, repo_id, unquote(rest[0]))
        if key == ("POST", "paths-info") and len(rest) == 1:
            return self.paths_info(req, repo_type, repo_id, unquote(rest[0]))
        if key == ("POST", "preupload") and len(rest) == 1:
            return self.preupload(req, repo_type, repo_id, unquote(rest[0]))
        if key == ("POST", "commit") and len(rest) == 1:
            return self.commit(req, repo_type, repo_id, unquote(rest[0]))
        if action in ("branch", "tag") and m in ("POST", "DELETE") and len(rest) == 1:
            return self.branch_or_tag(req, repo_type, repo_id, action, unquote(rest[0]))
        if key == ("PUT", "settings"):
            return self.settings(req, repo_type, repo_id)
        if action == "discussions":
            return self.discussions(req, repo_type, repo_id, rest)
        raise HubError(404, f"Unknown API route {m} /api/{'/'.join(parts)}")

    def route_git(self, req: Request, parts: list[str]) -> Response:
        repo_type = "model"
        if parts and parts[0] in ("datasets", "spaces") and len(parts) > 3:
            repo_type, parts = _URL_TYPES[parts[0]], parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve" and req.method in ("GET", "HEAD"):
            return self.resolve(req, repo_type, f"{parts[0]}/{parts[1]}", unquote(parts[3]),
                                unquote("/".join(parts[4:])))
        if (len(parts) == 6 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]
                and req.method == "POST"):
            return self.lfs_batch(req, repo_type, f"{parts[0]}/{parts[1][:-4]}")
        raise HubError(404, f"Not found: {req.path}")

    # ---- admin (loopback test control; deliberately unauthenticated) ---------------------------
    def admin(self, req: Request, parts: list[str]) -> Response:
        if parts == ["health"]:
            return json_response({"ok": True})
        if parts == ["faults"]:
            if req.method == "POST":
                try:
                    self.faults.add(req.json())
                except ValueError as exc:
                    raise HubError(400, str(exc)) from exc
            elif req.method == "DELETE":
                self.faults.clear()
            return json_response(self.faults.snapshot())
        if parts == ["gated"] and req.method == "POST":
            body = req.json()
            repo_type = body.get("repo_type", "model")
            if repo_type not in REPO_TYPES or not isinstance(body.get("repo_id"), str):
                raise HubError(400, "expected {'repo_id': 'ns/name', 'repo_type'?, 'gated'?, 'granted_users'?}")
            meta = self.set_gated(repo_type, body["repo_id"], body.get("gated", "auto"),
                                  body.get("granted_users", []))
            return json_response({"gated": meta["gated"], "granted": meta["granted"]})
        raise HubError(404, f"Unknown admin route {req.method} {req.path}")

    def repo_url(self, req: Request, repo_type: str, repo_id: str) -> str:
        return f"{req.base_url}/{URL_PREFIX[repo_type]}{repo_id}"


def parse_type_prefixed(key: str) -> tuple[str, str]:
    """'ns/name' -> model; 'datasets/ns/name' / 'spaces/ns/name' -> that type (CLI and seed syntax)."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] in ("datasets", "spaces"):
        return _URL_TYPES[parts[0]], "/".join(parts[1:])
    return "model", key
