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

from urllib.parse import unquote

from publisher.testing.hubserver.access import URL_TYPES
from publisher.testing.hubserver.jobs import JobRoutes, JobRunner
from publisher.testing.hubserver.reads import ReadRoutes
from publisher.testing.hubserver.storage import REPO_TYPES, HubError
from publisher.testing.hubserver.wire import Request, Response, error_response, json_response
from publisher.testing.hubserver.writes import WriteRoutes


class HubApp(ReadRoutes, WriteRoutes, JobRoutes):
    """Routing on top of the access rules (access.py), the read and write endpoints and Jobs (jobs.py)."""

    runner: JobRunner  # set by HubServer (the jobs' processes need a folder)

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
        self.faults.before_request(req.method, req.path)
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
        if parts and parts[0] == "jobs":
            return self.route_jobs(req, parts[1:])
        if n == 1 and parts[0] in URL_TYPES and m == "GET":
            return self.list_repos(req, URL_TYPES[parts[0]])
        if n < 3 or parts[0] not in URL_TYPES:
            raise HubError(404, f"Unknown API route /api/{'/'.join(parts)}")
        repo_type, repo_id = URL_TYPES[parts[0]], f"{parts[1]}/{parts[2]}"
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
        if m == "GET" and action in ("xet-read-token", "xet-write-token") and len(rest) == 1:
            return self.xet_token(req, repo_type, repo_id, action.split("-")[1], unquote(rest[0]))
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
            repo_type, parts = URL_TYPES[parts[0]], parts[1:]
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
        if parts == ["virtual"] and req.method == "POST":
            return self.add_virtual(req.json())
        raise HubError(404, f"Unknown admin route {req.method} {req.path}")

    def add_virtual(self, body: dict) -> Response:
        """Commit virtual LFS files to an existing repo's main branch: {"repo_id", "files": {path: {"header", "size",
        "seed", "sha256"}}, "xet"?: bool}. The sha256 is taken as given (a wrong one makes a base whose bytes fail
        their oid). With "xet", the bytes are also uploaded into the Xet store (on disk, once), so that downloads take
        huggingface_hub's Xet path as they do on huggingface.co; without it they are served by HTTP only."""
        from publisher.testing.hubserver.storage import make_entry, validate_path

        repo_type, ops = body.get("repo_type", "model"), []
        for path, spec in (body.get("files") or {}).items():
            sha = str(spec.get("sha256", ""))
            self.store.add_virtual(sha, {k: spec[k] for k in ("header", "size", "seed", "noise") if k in spec})
            xet_hash = self.into_store(sha) if body.get("xet") else None
            ops.append(("add", validate_path(path), make_entry(sha, int(spec["size"]), True, xet_hash=xet_hash)))
        sha = self.store.apply_commit(repo_type, str(body.get("repo_id")), "main", ops, "Add virtual files", "", "admin")
        return json_response({"commit": sha})
