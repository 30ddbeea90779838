"""Read-only endpoints: whoami, repo info, tree, refs, commits, paths-info, resolve (file download), Xet tokens.

``resolve/`` answers as huggingface.co does: a regular (git) file directly; an LFS file with 302 to a signed URL on
the storage bridge, another origin (bridge.py), carrying its metadata (``X-Linked-Etag``, ``X-Linked-Size``) and,
for a Xet-backed file, ``X-Xet-Hash`` plus the ``Link: <.../xet-read-token/{sha}>; rel="xet-auth"`` through which
huggingface_hub downloads it with hf_xet instead.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from publisher.testing.hubserver.access import HubAccess
from publisher.testing.hubserver.faults import FaultInjector
from publisher.testing.hubserver.storage import HubError, Store
from publisher.testing.hubserver.wire import Request, Response, json_response

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


def front_matter(text: str) -> tuple[str | None, str | None]:
    """(yaml_text, error) of a README's leading '---' block; (None, None) when there is none."""
    lines = text.replace("\r\n", "\n").split("\n")
    if not lines or lines[0].strip() != "---":
        return None, None
    for i in range(1, len(lines)):
        if lines[i].strip() == "---":
            return "\n".join(lines[1:i]), None
    return None, "README.md front matter starts with '---' but is never closed"


def parse_card_data(text: str) -> tuple[dict | None, str | None]:
    """(cardData, error). pyyaml is optional: without it the server simply reports no card data."""
    block, err = front_matter(text)
    if block is None:
        return None, err
    try:
        import yaml
    except ImportError:  # keep the server standard-library only when pyyaml is absent
        return None, None
    try:
        data = yaml.safe_load(block)
    except yaml.YAMLError as exc:
        return None, f"Invalid YAML in README.md metadata: {exc}"
    if data is None:
        return {}, None
    if not isinstance(data, dict):
        return None, "README.md metadata must be a YAML mapping"
    return data, None


def file_json(path: str, entry: dict) -> dict:
    out: dict[str, Any] = {"type": "file", "path": path, "size": entry["size"], "oid": entry["oid"]}
    if entry["lfs"]:
        out["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": entry["pointerSize"]}
    if entry.get("xet_hash"):
        out["xetHash"] = entry["xet_hash"]
    return out


def folder_json(path: str, tree: dict) -> dict:
    # Git tree oids are not needed by the client beyond being stable strings; hash the listing.
    listing = sorted((p, e["oid"]) for p, e in tree.items() if p.startswith(path + "/"))
    return {"type": "directory", "path": path, "size": 0, "oid": hashlib.sha1(repr(listing).encode()).hexdigest()}


def list_tree(tree: dict, path: str, recursive: bool) -> list[dict]:
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    if prefix and prefix.rstrip("/") in tree:
        raise HubError(400, f"{path} is a file, not a folder")
    files: list[dict[str, Any]] = []
    folders: set[str] = set()
    for p, e in tree.items():
        if not p.startswith(prefix):
            continue
        rest = p[len(prefix):].split("/")
        if recursive:
            folders.update(prefix + "/".join(rest[:i]) for i in range(1, len(rest)))
            files.append(file_json(p, e))
        elif len(rest) == 1:
            files.append(file_json(p, e))
        else:
            folders.add(prefix + rest[0])
    if prefix and not files and not folders:
        raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
    entries = [folder_json(f, tree) for f in folders] + files
    return sorted(entries, key=lambda x: x["path"])


def paths_info(tree: dict, paths: Iterable[str]) -> list[dict]:
    out = []
    for p in paths:
        p = p.strip("/")
        if p in tree:
            out.append(file_json(p, tree[p]))
        elif any(q.startswith(p + "/") for q in tree):
            out.append(folder_json(p, tree))
    return out


class ReadRoutes(HubAccess):
    def whoami(self, req: Request) -> Response:
        if req.user is None:
            raise HubError(401, "You must be authenticated to call whoami (no token sent)")
        orgs = [{"type": "org", "name": o, "fullname": o, "roleInOrg": "write"} for o in self.orgs_of(req.user)]
        return json_response({
            "type": "user", "id": req.user, "name": req.user, "fullname": req.user, "orgs": orgs,
            "auth": {"type": "access_token", "accessToken": self.access_token(req.token)},
        })

    def validate_yaml(self, req: Request) -> Response:
        # The client calls .json() before checking the status, so even errors must be JSON.
        _, err = parse_card_data(str(req.json().get("content", "")))
        if err:
            return json_response({"errors": [{"message": err}], "warnings": []}, 400)
        return json_response({"errors": [], "warnings": []})

    def list_repos(self, req: Request, repo_type: str) -> Response:
        author, search = req.q("author"), (req.q("search") or "").lower()
        out = []
        for meta in self.store.list_repos(repo_type):
            ns = meta["id"].split("/")[0]
            if meta["private"] and not self.is_member(req.user, ns):
                continue
            if (author and ns != author) or search not in meta["id"].lower():
                continue
            out.append({"id": meta["id"], "private": meta["private"], "gated": meta.get("gated") or False,
                        "sha": meta["refs"].get("refs/heads/main"), "lastModified": meta.get("lastModified"),
                        "createdAt": meta["createdAt"], "downloads": 0, "likes": 0, "tags": []})
        return json_response(out)

    def card_data(self, tree: dict) -> dict | None:
        entry = tree.get("README.md")
        if entry is None or entry["size"] > 1_000_000:
            return None
        card, _ = parse_card_data(self.store.read_blob(entry["sha256"]).decode("utf-8", "replace"))
        return card

    def repo_info(self, req: Request, repo_type: str, repo_id: str, rev: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        commit = self.store.resolve(meta, rev)
        blobs = req.flag("blobs")
        siblings = []
        for path in sorted(commit["tree"]):
            entry, sib = commit["tree"][path], {"rfilename": path}
            if blobs:
                sib.update(size=entry["size"], blobId=entry["oid"])
                if entry["lfs"]:
                    sib["lfs"] = {"sha256": entry["sha256"], "size": entry["size"], "pointerSize": entry["pointerSize"]}
            siblings.append(sib)
        card = self.card_data(commit["tree"]) or {}
        tags: list[Any] = card["tags"] if isinstance(card.get("tags"), list) else []
        info: dict[str, Any] = {
            "_id": meta["id"], "id": meta["id"], "author": meta["id"].split("/")[0], "sha": commit["id"],
            "lastModified": commit["date"], "createdAt": meta["createdAt"], "private": meta["private"],
            "gated": meta.get("gated") or False, "disabled": False, "downloads": 0, "likes": 0,
            "tags": [str(t) for t in tags], "siblings": siblings,
        }
        if card:
            info["cardData"] = card
            for key in ("library_name", "pipeline_tag"):
                if isinstance(card.get(key), str):
                    info[key] = card[key]
        if repo_type == "space":
            info["sdk"] = card.get("sdk")
        return json_response(info)

    def tree(self, req: Request, repo_type: str, repo_id: str, rev: str, path: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        commit = self.store.resolve(meta, rev)
        # One page only: pagination (Link: rel="next") is optional for the client.
        return json_response(list_tree(commit["tree"], path, req.flag("recursive")))

    def paths_info(self, req: Request, repo_type: str, repo_id: str, rev: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        commit = self.store.resolve(meta, rev)
        if "json" in (req.headers.get("Content-Type") or ""):
            paths = req.json().get("paths", [])
        else:  # the client sends a form: paths=a&paths=b&expand=False
            paths = parse_qs(req.read_body().decode(), keep_blank_values=True).get("paths", [])
        return json_response(paths_info(commit["tree"], [paths] if isinstance(paths, str) else paths))

    def refs(self, req: Request, repo_type: str, repo_id: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        out: dict[str, list] = {"branches": [], "tags": [], "converts": []}
        prs = []
        for ref, sha in sorted(meta["refs"].items()):
            if ref.startswith("refs/heads/"):
                out["branches"].append({"name": ref[11:], "ref": ref, "targetCommit": sha})
            elif ref.startswith("refs/tags/"):
                out["tags"].append({"name": ref[10:], "ref": ref, "targetCommit": sha})
            elif ref.startswith("refs/pr/"):
                prs.append({"name": ref, "ref": ref, "targetCommit": sha})
        if req.flag("include_prs"):
            out["pullRequests"] = sorted(prs, key=lambda r: int(r["ref"].rsplit("/", 1)[1]))
        return json_response(out)

    def commits(self, req: Request, repo_type: str, repo_id: str, rev: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        out = []
        for c in self.store.history(meta, rev):
            message = c["title"] + (f"\n\n{c['message']}" if c["message"] else "")
            item = {"id": c["id"], "title": c["title"], "message": message, "date": c["date"],
                    "authors": [{"user": c["author"]}]}
            if req.q("expand[]") == "formatted":
                item["formatted"] = {"title": c["title"], "message": message}
            out.append(item)
        return json_response(out)

    bridge_url: str = ""  # the storage bridge's origin (set by the server once it is bound)

    def resolve(self, req: Request, repo_type: str, repo_id: str, rev: str, path: str) -> Response:
        meta = self.readable_repo(repo_type, repo_id, req)
        self.check_gate(meta, req)
        commit = self.store.resolve(meta, rev)
        entry = commit["tree"].get(path)
        if entry is None:
            raise HubError(404, f"Entry not found: {path} at {rev}", "EntryNotFound")
        headers = {
            "X-Repo-Commit": commit["id"],  # required: the client caches snapshots by commit sha
            # Git blob sha1 for regular files, sha256 for LFS ones, like the Hub.
            "ETag": f'"{entry["sha256"] if entry["lfs"] else entry["oid"]}"',
        }
        if not entry["lfs"]:
            return serve_range(req, self.store, self.faults, entry["sha256"], entry["size"], headers, req.path)
        headers.update({"X-Linked-Etag": f'"{entry["sha256"]}"', "X-Linked-Size": str(entry["size"]),
                        "Location": self.signed_url(req.path, entry["sha256"])})
        if entry.get("xet_hash"):
            token_url = f"{req.base_url}/api/{repo_type}s/{repo_id}/xet-read-token/{commit['id']}"
            headers.update({"X-Xet-Hash": entry["xet_hash"], "Link": f'<{token_url}>; rel="xet-auth"'})
        return Response(302, b"", headers)

    def signed_url(self, resolve_path: str, oid: str) -> str:
        """A storage-bridge URL for one object, valid for an hour; its signature is the only credential it takes. The
        path repeats the resolve path, so fault rules that match a file's resolve path also match its bridge reads."""
        where = f"/_bridge{resolve_path}"
        exp = int(time.time()) + 3600
        return f"{self.bridge_url}{where}?oid={oid}&exp={exp}&sig={bridge_sig(self.store, where, oid, exp)}"


def bridge_sig(store: Store, where: str, oid: str, exp: int) -> str:
    return hmac.new(store.secret, f"bridge:{where}:{oid}:{exp}".encode(), hashlib.sha256).hexdigest()


def serve_range(req: Request, store: Store, faults: FaultInjector, sha256: str, size: int, headers: dict[str, str],
                fault_path: str) -> Response:
    """A file's bytes (HEAD, GET, or GET with ``Range``), with the body faults that match ``fault_path``."""
    headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **headers}
    start, end, status = 0, size - 1, 200
    rng = req.headers.get("Range")
    if rng and req.method == "GET" and faults.take("ignore_range", "GET", fault_path):
        rng = None  # a faulty proxy: the whole file, 200
    if rng and req.method == "GET":
        m = _RANGE_RE.match(rng.strip())
        if m and (m.group(1) or m.group(2)):
            if m.group(1):
                start, end = int(m.group(1)), min(int(m.group(2) or size - 1), size - 1)
            else:  # suffix range: the last N bytes
                start = max(size - int(m.group(2)), 0)
            if start >= size or start > end:
                return Response(416, b"", {"Content-Range": f"bytes */{size}", **headers})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    fault = faults.take_body(fault_path, start, end, size) if req.method == "GET" else None
    blob = store.blob_path(sha256)
    if not blob.is_file():
        virtual = store.virtual(sha256)
        if virtual is not None:  # computed as it is sent: a benchmark base that never sits on a disk
            return Response(status, b"", headers, virtual=virtual.read, file_range=(start, end), body_fault=fault)
        if store.discarded(sha256):
            raise HubError(410, f"this loopback Hub runs with --discard-lfs: the bytes of {fault_path} were checked "
                                "on upload and dropped")
    return Response(status, b"", headers, file=blob, file_range=(start, end), body_fault=fault)
