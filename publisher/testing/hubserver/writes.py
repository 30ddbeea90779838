"""Write endpoints: repos, preupload, LFS batch + presigned PUT, commits, branches/tags, settings, PRs."""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
import time

from publisher.testing.hubserver.lfs import LfsRoutes
from publisher.testing.hubserver.storage import HubError, make_entry, validate_path, validate_repo_id
from publisher.testing.hubserver.wire import Request, Response, json_response
from publisher.testing.hubserver.xet import READ_TOKEN_S, cas_url

LFS_THRESHOLD = 10 * 1024 * 1024
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx", ".msgpack", ".h5", ".model",
                ".zip", ".tar", ".gz", ".png", ".jpg")
_BRANCH_RE = re.compile(r"^(?!refs/)(?!.*\.\.)[A-Za-z0-9._/-]{1,200}$")


def upload_mode(path: str, size: int, sample: bytes) -> str:
    if size >= LFS_THRESHOLD or b"\0" in sample or path.lower().endswith(LFS_SUFFIXES):
        return "lfs"
    return "regular"


class WriteRoutes(LfsRoutes):
    # ---- repos -------------------------------------------------------------------------------
    def create_repo(self, req: Request) -> Response:
        body = req.json()
        repo_type = body.get("type") or "model"
        if req.user is None:
            raise HubError(401, "You must be authenticated to create a repo (no token sent)")
        repo_id = f"{body.get('organization') or req.user}/{body.get('name')}"
        validate_repo_id(repo_id)
        url = self.repo_url(req, repo_type, repo_id)
        self.require_writer(req, repo_id.split("/")[0], f"create a repo under '{repo_id.split('/')[0]}'")
        private = body.get("visibility") == "private" or bool(body.get("private"))
        try:
            self.store.create_repo(repo_type, repo_id, private, req.user)
        except HubError as err:
            # With exist_ok the client swallows the 409 but still reads r.json()["url"].
            err.extra["url"] = url
            raise
        for key in (repo_id, f"{repo_type}s/{repo_id}"):
            if key in self.gated_seed:
                self.apply_gated_seed(key)
        return json_response({"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self, req: Request) -> Response:
        body = req.json()
        repo_type = body.get("type") or "model"
        repo_id = f"{body.get('organization') or req.user}/{body.get('name')}"
        self.readable_repo(repo_type, repo_id, req)
        self.require_writer(req, repo_id.split("/")[0], f"delete {repo_id}", repo_id)
        self.store.delete_repo(repo_type, repo_id)
        return json_response({})

    def settings(self, req: Request, repo_type: str, repo_id: str) -> Response:
        self.readable_repo(repo_type, repo_id, req)
        self.require_writer(req, repo_id.split("/")[0], f"change the settings of {repo_id}", repo_id)
        body, changes = req.json(), {}
        if "private" in body:
            changes["private"] = bool(body["private"])
        if "visibility" in body:
            changes["private"] = body["visibility"] == "private"
        if "gated" in body:
            changes["gated"] = body["gated"] or False
        meta = self.store.update_repo(repo_type, repo_id, **changes)
        return json_response({"private": meta["private"], "gated": meta["gated"]})

    # ---- commit access -----------------------------------------------------------------------
    def require_commit_access(self, req: Request, meta: dict, rev: str, create_pr: bool) -> None:
        """Members write anywhere; other authenticated readers may open PRs and push to their own PRs. Either way the
        token needs ``repo.write`` on the repo or its namespace (a fine-grained token opening a PR on someone else's
        repo: ``discussion.write``)."""
        ns, repo_id = meta["id"].split("/")[0], meta["id"]
        if self.is_member(req.user, ns):
            self.require_writer(req, ns, f"commit to {repo_id}", repo_id)
            return
        if req.user is not None:
            pr = re.fullmatch(r"refs/pr/(\d+)", rev)
            own_pr = pr is not None and any(d["num"] == int(pr.group(1)) and d["author"] == req.user
                                            for d in meta["discussions"])
            if create_pr or own_pr:
                if not (self.granted(req, "repo.write", repo_id) or self.granted(req, "discussion.write", repo_id)):
                    self.require_permission(req, "discussion.write", repo_id)
                return
        self.require_writer(req, ns, f"commit to {repo_id}", repo_id)

    def xet_token(self, req: Request, repo_type: str, repo_id: str, kind: str, rev: str) -> Response:
        """``xet-write-token`` / ``xet-read-token``: a CAS folder for this token alone (xet.py says why), as the JSON
        and the headers through which huggingface_hub and hf_xet connect. Writing needs commit access to ``rev`` (a PR's
        upload asks ``.../xet-write-token/None?create_pr=1``); reading gets a snapshot of the store, with the Xet body
        faults (``xet_flip`` / ``xet_truncate``) that match a file of that revision applied to its copy."""
        meta = self.readable_repo(repo_type, repo_id, req)
        if kind == "write":
            create_pr = req.flag("create_pr") or rev == "None"
            self.require_commit_access(req, meta, "main" if rev == "None" else rev, create_pr)
            folder = self.xet.new_incoming()
        else:
            self.check_gate(meta, req)
            tree = self.store.resolve(meta, rev)["tree"]
            paths = {e["xet_hash"]: f"/{repo_id}/resolve/{rev}/{p}" for p, e in tree.items() if e.get("xet_hash")}

            def corrupt(xet_hash: str) -> str | None:
                for how in ("flip", "truncate"):
                    if self.faults.take(f"xet_{how}", "GET", paths.get(xet_hash, "")) is not None:
                        return how
                return None

            folder = self.xet.snapshot(paths, corrupt)
        # While Xet faults are set, a read token is already inside huggingface_hub's 60 s safety margin, so the
        # client asks for a new one (a new snapshot) for each download: a fault with count=1 damages one download.
        lifetime = 60 if self.faults.pending("xet_flip", "xet_truncate") else READ_TOKEN_S
        exp = int(time.time()) + lifetime
        token = secrets.token_hex(16)
        return json_response({"accessToken": token, "exp": exp, "casUrl": cas_url(folder)}, headers={
            "X-Xet-Cas-Url": cas_url(folder), "X-Xet-Access-Token": token, "X-Xet-Token-Expiration": str(exp)})

    def preupload(self, req: Request, repo_type: str, repo_id: str, rev: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        create_pr = req.flag("create_pr")
        self.require_commit_access(req, meta, rev, create_pr)
        tree = self.store.resolve(meta, rev)["tree"]
        out = []
        for f in req.json().get("files", []):
            try:
                sample = base64.b64decode(f.get("sample", ""))
            except binascii.Error as exc:
                raise HubError(400, f"Invalid base64 sample for {f.get('path')}") from exc
            mode = upload_mode(f["path"], int(f.get("size", 0)), sample)
            existing, oid = tree.get(f["path"]), None
            # Returning the current oid lets the client skip unchanged files (sha256 for LFS, git sha1 else).
            if existing is not None and existing["lfs"] == (mode == "lfs"):
                oid = existing["sha256"] if existing["lfs"] else existing["oid"]
            out.append({"path": f["path"], "uploadMode": mode, "shouldIgnore": False, "oid": oid})
        return json_response({"files": out})

    # ---- commit ------------------------------------------------------------------------------
    def commit(self, req: Request, repo_type: str, repo_id: str, rev: str) -> Response:
        fault = self.faults.take("commit_status", "POST", req.path)
        if fault is not None and not fault.apply:
            req.read_body()
            raise HubError(fault.status, f"Injected fault: commit answered HTTP {fault.status}")
        meta = self.readable_repo(repo_type, repo_id, req)
        create_pr = req.flag("create_pr")
        self.require_commit_access(req, meta, rev, create_pr)
        try:
            lines = [json.loads(line) for line in req.read_body().splitlines() if line.strip()]
        except ValueError as exc:
            raise HubError(400, f"Malformed ndjson commit payload: {exc}") from exc
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first line of a commit payload must be the header")
        header = lines[0].get("value", {})
        ops: list[tuple] = []
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            raw_path = str(value.get("path", ""))
            path = validate_path(raw_path.rstrip("/") if key == "deletedFolder" else raw_path)
            if key == "file":
                try:
                    data = base64.b64decode(value.get("content", ""))
                except binascii.Error as exc:
                    raise HubError(400, f"Invalid base64 content for {path}") from exc
                if len(data) > LFS_THRESHOLD:
                    raise HubError(400, f"{path} is larger than 10 MiB: upload it through LFS")
                ops.append(("add", path, make_entry(self.store.put_bytes(data), len(data), False, data)))
            elif key == "lfsFile":
                size = value.get("size")
                ops.append(("add", path, self.lfs_entry(str(value.get("oid", "")), None if size is None else int(size), path)))
            elif key in ("deletedFile", "deletedFolder"):
                ops.append(("delete_file" if key == "deletedFile" else "delete_folder", path))
            else:
                raise HubError(400, f"Unknown commit operation {key!r}")
        title = str(header.get("summary") or "").strip() or "Upload files"
        parent = header.get("parentCommit")
        target, pr_url = rev, None
        if create_pr:
            disc = self.store.create_discussion(repo_type, repo_id, title, header.get("description") or "",
                                                req.user or "", True, base_rev=rev, start_sha=parent)
            target, parent = disc["ref"], None
            pr_url = f"{self.repo_url(req, repo_type, repo_id)}/discussions/{disc['num']}"
        try:
            sha = self.store.apply_commit(repo_type, repo_id, target, ops, title, header.get("description") or "",
                                          req.user or "", parent_commit=parent)
        except HubError:
            if pr_url is not None:  # don't leave an open PR behind a commit that never landed
                self.store.set_discussion_status(repo_type, repo_id, int(target.rsplit("/", 1)[1]), "closed")
            raise
        if fault is not None:  # "apply": the commit landed but the client is told it failed
            raise HubError(fault.status, f"Injected fault after applying commit {sha}")
        return json_response({"success": True, "commitOid": sha, "pullRequestUrl": pr_url,
                              "commitUrl": f"{self.repo_url(req, repo_type, repo_id)}/commit/{sha}"})

    # ---- refs --------------------------------------------------------------------------------
    def branch_or_tag(self, req: Request, repo_type: str, repo_id: str, kind: str, name: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        self.require_writer(req, meta["id"].split("/")[0], f"create or delete a {kind} in {repo_id}", repo_id)
        if req.method == "DELETE":
            self.store.delete_ref(repo_type, repo_id, f"refs/{'heads' if kind == 'branch' else 'tags'}/{name}")
            return json_response({})
        body = req.json()
        if kind == "branch":  # POST /branch/{branch} {"startingPoint"?}
            ref, start = f"refs/heads/{name}", body.get("startingPoint")
        else:  # POST /tag/{revision} {"tag", "message"?}
            ref, start = f"refs/tags/{body.get('tag', '')}", name
        if not _BRANCH_RE.match(ref.split("/", 2)[2]):
            raise HubError(400, f"Invalid {kind} name {ref.split('/', 2)[2]!r}")
        self.store.create_ref(repo_type, repo_id, ref, start)
        return json_response({})

    # ---- discussions / pull requests ---------------------------------------------------------
    def discussion_json(self, meta: dict, d: dict, details: bool = False) -> dict:
        out = {"num": d["num"], "title": d["title"], "author": {"name": d["author"]}, "createdAt": d["createdAt"],
               "status": d["status"], "isPullRequest": d["isPullRequest"],
               "repo": {"name": meta["id"], "type": meta["type"]}}
        if details:
            out.update(events=[], filesWithConflicts=[], diff="", changes={"base": d.get("base")},
                       description=d.get("description", ""))
        return out

    def discussions(self, req: Request, repo_type: str, repo_id: str, rest: list[str]) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        if not rest and req.method == "GET":
            kind, status, author = req.q("type"), req.q("status"), req.q("author")
            items = [self.discussion_json(meta, d) for d in reversed(meta["discussions"])
                     if (kind in (None, "all") or (kind == "pull_request") == d["isPullRequest"])
                     and (status in (None, "all") or status == d["status"])
                     and (author is None or author == d["author"])]
            page = int(req.q("p") or 0)  # everything fits in page 0; later pages are empty
            return json_response({"discussions": items if page == 0 else [], "count": len(items),
                                  "start": 0 if page == 0 else len(items), "numClosedDiscussions": 0})
        if not rest and req.method == "POST":
            if req.user is None:
                raise HubError(401, "You must be authenticated to open a discussion (no token sent)")
            body = req.json()
            d = self.store.create_discussion(repo_type, repo_id, str(body.get("title", "")).strip() or "Untitled",
                                             body.get("description") or "", req.user, bool(body.get("pullRequest")))
            return json_response({"num": d["num"], "url": f"{self.repo_url(req, repo_type, repo_id)}"
                                                          f"/discussions/{d['num']}"})
        if not rest[0].isdigit():
            raise HubError(404, f"Discussion {rest[0]} not found")
        num = int(rest[0])
        d = self.store.get_discussion(meta, num)
        if len(rest) == 1 and req.method == "GET":
            return json_response(self.discussion_json(meta, d, details=True))
        if rest[1:] == ["status"] and req.method == "POST":
            if req.user != d["author"]:
                self.require_writer(req, repo_id.split("/")[0], f"change the status of #{num}", repo_id)
            new = str(req.json().get("status", ""))
            if new not in ("open", "closed"):
                raise HubError(400, "status must be 'open' or 'closed'")
            self.store.set_discussion_status(repo_type, repo_id, num, new)
            return json_response({"newStatus": {"id": f"status-{num}", "type": "status-change",
                                                "createdAt": d["createdAt"], "author": {"name": req.user},
                                                "data": {"status": new}}})
        if rest[1:] == ["merge"] and req.method == "POST":
            self.require_writer(req, repo_id.split("/")[0], f"merge #{num}", repo_id)
            return json_response({"commitOid": self.store.merge_pr(repo_type, repo_id, num, req.user or "")})
        raise HubError(404, f"Unknown discussion route {req.method} {'/'.join(rest)}")
