"""A small git-like, content-addressed store behind the loopback Hub server.

Layout under the data folder (everything is JSON or raw bytes, so a restart only re-reads files):

    secret                        HMAC key for presigned LFS upload URLs (kept so hrefs survive a restart)
    blobs/ab/<sha256>             file contents, addressed by sha256 (regular and LFS files alike)
    tmp/                          partial uploads; renamed into blobs/ only once size and sha256 match
    repos/<type>s/<ns>/<name>/repo.json          visibility, gating, refs, discussions
    repos/<type>s/<ns>/<name>/commits/<sha>.json one immutable commit with its full tree

A commit holds the whole tree ({path: entry}) rather than a diff: trees here are small and this keeps
`resolve/<any past sha>/...` a single file read. Every metadata change happens under one lock and is
written with write-to-temp + os.replace, so a killed server never leaves half-written JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_TYPES = ("model", "dataset", "space")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_DEFAULT_GITATTRIBUTES = (
    "*.bin filter=lfs diff=lfs merge=lfs -text\n"
    "*.ckpt filter=lfs diff=lfs merge=lfs -text\n"
    "*.gguf filter=lfs diff=lfs merge=lfs -text\n"
    "*.h5 filter=lfs diff=lfs merge=lfs -text\n"
    "*.msgpack filter=lfs diff=lfs merge=lfs -text\n"
    "*.onnx filter=lfs diff=lfs merge=lfs -text\n"
    "*.pt filter=lfs diff=lfs merge=lfs -text\n"
    "*.pth filter=lfs diff=lfs merge=lfs -text\n"
    "*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    "*.zip filter=lfs diff=lfs merge=lfs -text\n"
)


class HubError(Exception):
    """An error that maps 1:1 onto an HTTP answer (status, X-Error-Code, X-Error-Message, JSON body)."""

    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}
        self.headers = headers or {}


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob, which is what the Hub reports as ETag/oid for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def make_entry(sha256: str, size: int, lfs: bool, data: bytes | None = None, xet_hash: str | None = None) -> dict[str, Any]:
    """A tree entry. For LFS files git stores the pointer, so the git oid is the pointer's blob sha1; ``xet_hash``:
    the file's hash in the Xet store (None: its bytes are not there, e.g. dropped by ``discard_lfs``)."""
    if lfs:
        pointer = lfs_pointer(sha256, size)
        return {"sha256": sha256, "size": size, "lfs": True, "oid": git_blob_sha1(pointer), "pointerSize": len(pointer),
                "xet_hash": xet_hash}
    assert data is not None
    return {"sha256": sha256, "size": size, "lfs": False, "oid": git_blob_sha1(data)}


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def validate_repo_id(repo_id: str) -> tuple[str, str]:
    parts = repo_id.split("/")
    # Names become folder names: the regex (no '/', no leading '.') is what keeps paths inside data/.
    if len(parts) != 2 or not all(_NAME_RE.match(p) and ".." not in p for p in parts):
        raise HubError(400, f"Invalid repo id {repo_id!r}: expected 'namespace/name'")
    return parts[0], parts[1]


def validate_path(path: str) -> str:
    if not path or path.startswith("/") or any(seg in ("", ".", "..") for seg in path.split("/")):
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


class Store:
    """Repos, refs, commits and blobs on disk. Thread-safe; one process per data folder."""

    def __init__(self, root: str | os.PathLike[str], discard_lfs: bool = False) -> None:
        self.root = Path(root)
        # Benchmarks only: LFS uploads are checked (size, sha256) and recorded, their bytes dropped. On a real
        # runner the Hub's storage is not the runner's disk; here it would be, and would double the disk writes.
        self.discard_lfs = discard_lfs
        for sub in ("blobs", "tmp", "repos"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        secret_file = self.root / "secret"
        if not secret_file.exists():
            secret_file.write_text(secrets.token_hex(32))
        self.secret = secret_file.read_text().strip().encode()
        self.lock = threading.RLock()
        self._commit_cache: dict[tuple[str, str], dict] = {}

    # ---- blobs -------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise HubError(400, f"Invalid sha256 oid {sha256!r}")
        return self.root / "blobs" / sha256[:2] / sha256

    def has_blob(self, sha256: str, size: int | None = None) -> bool:
        known = self.blob_size(sha256)
        return known is not None and (size is None or known == size)

    def blob_size(self, sha256: str) -> int | None:
        """The size of a stored (or checked and discarded) object; None if there is none."""
        p = self.blob_path(sha256)
        if p.is_file():
            return p.stat().st_size
        dropped = self._discarded(sha256)
        return int(json.loads(dropped.read_text())["size"]) if dropped.is_file() else None

    def _discarded(self, sha256: str) -> Path:
        return self.root / "discarded" / f"{sha256}.json"

    def discarded(self, sha256: str) -> bool:
        return self._discarded(sha256).is_file()

    def adopt_upload(self, tmp: str, sha256: str, size: int) -> None:
        """A verified LFS upload: into the blob store, or (``discard_lfs``) recorded by size and dropped."""
        if not self.discard_lfs:
            self.adopt_tmp(tmp, sha256)
            return
        os.unlink(tmp)
        _write_json(self._discarded(sha256), {"size": size})

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.has_blob(sha):
            fd, tmp = tempfile.mkstemp(dir=self.root / "tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            self.adopt_tmp(tmp, sha)
        return sha

    def new_tmp(self) -> tuple[int, str]:
        return tempfile.mkstemp(dir=self.root / "tmp", prefix="upload-")

    def adopt_tmp(self, tmp: str, sha256: str) -> None:
        """Move a fully written and verified temp file into the blob store (atomic rename)."""
        dest = self.blob_path(sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)

    def read_blob(self, sha256: str) -> bytes:
        return self.blob_path(sha256).read_bytes()

    # ---- virtual blobs: bytes computed as they are served (testing/virtual.py), never stored -------
    def add_virtual(self, sha256: str, spec: dict) -> None:
        self.blob_path(sha256)  # validates the oid
        _write_json(self.root / "virtual" / f"{sha256}.json", spec)

    def virtual(self, sha256: str) -> Any:
        """The VirtualFile behind an oid that has no stored blob, or None."""
        from publisher.testing.virtual import VirtualFile

        path = self.root / "virtual" / f"{sha256}.json"
        return VirtualFile.from_json(json.loads(path.read_text())) if path.is_file() else None

    # ---- repos -------------------------------------------------------------------------------
    def _repo_dir(self, repo_type: str, repo_id: str) -> Path:
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        ns, name = validate_repo_id(repo_id)
        return self.root / "repos" / f"{repo_type}s" / ns / name

    def get_repo(self, repo_type: str, repo_id: str) -> dict | None:
        p = self._repo_dir(repo_type, repo_id) / "repo.json"
        with self.lock:
            return json.loads(p.read_text()) if p.is_file() else None

    def _save_repo(self, meta: dict) -> None:
        _write_json(self._repo_dir(meta["type"], meta["id"]) / "repo.json", meta)

    def list_repos(self, repo_type: str) -> list[dict]:
        base = self.root / "repos" / f"{repo_type}s"
        with self.lock:
            return [json.loads(p.read_text()) for p in sorted(base.glob("*/*/repo.json"))]

    def create_repo(self, repo_type: str, repo_id: str, private: bool, author: str) -> dict:
        """Create a repo with an initial commit holding .gitattributes, as huggingface.co does."""
        with self.lock:
            if self.get_repo(repo_type, repo_id) is not None:
                raise HubError(409, "You already created this repo")
            meta: dict[str, Any] = {
                "type": repo_type, "id": repo_id, "private": bool(private), "gated": False, "granted": [],
                "createdAt": now_iso(), "refs": {}, "discussions": [],
            }
            data = _DEFAULT_GITATTRIBUTES.encode()
            entry = make_entry(self.put_bytes(data), len(data), False, data)
            sha = self._write_commit(meta, None, {".gitattributes": entry}, "initial commit", "", author)
            meta["refs"]["refs/heads/main"] = sha
            meta["lastModified"] = meta["createdAt"]
            self._save_repo(meta)
            return meta

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        with self.lock:
            d = self._repo_dir(repo_type, repo_id)
            if not (d / "repo.json").is_file():
                raise HubError(404, "Repository not found", "RepoNotFound")
            # Rename first so a crash mid-rmtree never leaves a half-deleted repo that still looks valid.
            trash = self.root / "tmp" / f"deleted-{secrets.token_hex(8)}"
            os.replace(d, trash)
            self._commit_cache = {k: v for k, v in self._commit_cache.items() if k[0] != str(d)}
        shutil.rmtree(trash, ignore_errors=True)

    def update_repo(self, repo_type: str, repo_id: str, **changes: Any) -> dict:
        with self.lock:
            meta = self.require_repo(repo_type, repo_id)
            meta.update(changes)
            self._save_repo(meta)
            return meta

    def require_repo(self, repo_type: str, repo_id: str) -> dict:
        meta = self.get_repo(repo_type, repo_id)
        if meta is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return meta

    # ---- commits and refs --------------------------------------------------------------------
    def _write_commit(self, meta: dict, parent: str | None, tree: dict, title: str, message: str, author: str) -> str:
        # A random nonce makes every commit a new sha, even an identical retry (as on the Hub).
        date = now_iso()
        seed = json.dumps([parent, sorted(tree.items()), title, message, author, date, secrets.token_hex(8)])
        sha = hashlib.sha1(seed.encode()).hexdigest()
        commit = {"id": sha, "parents": [parent] if parent else [], "title": title, "message": message,
                  "author": author, "date": date, "tree": tree}
        _write_json(self._repo_dir(meta["type"], meta["id"]) / "commits" / f"{sha}.json", commit)
        return sha

    def get_commit(self, meta: dict, sha: str) -> dict | None:
        if not _SHA_RE.match(sha):
            return None
        d = self._repo_dir(meta["type"], meta["id"])
        key = (str(d), sha)
        if key not in self._commit_cache:
            p = d / "commits" / f"{sha}.json"
            if not p.is_file():
                return None
            if len(self._commit_cache) > 4096:  # bound memory on long-running servers
                self._commit_cache.clear()
            self._commit_cache[key] = json.loads(p.read_text())  # commits are immutable: safe to cache
        return self._commit_cache[key]

    @staticmethod
    def ref_name(meta: dict, rev: str) -> str | None:
        """Map a user revision ('main', 'refs/heads/main', 'v1', 'refs/pr/3') to a full ref, if it exists."""
        refs = meta["refs"]
        for cand in (rev, f"refs/heads/{rev}", f"refs/tags/{rev}"):
            if cand in refs and cand.startswith("refs/"):
                return cand
        return None

    def resolve(self, meta: dict, rev: str) -> dict:
        """Commit for a branch, tag, PR ref or full sha; 404 RevisionNotFound otherwise."""
        ref = self.ref_name(meta, rev)
        commit = self.get_commit(meta, meta["refs"][ref] if ref else rev)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return commit

    def history(self, meta: dict, rev: str) -> list[dict]:
        out: list[dict] = []
        commit: dict | None = self.resolve(meta, rev)
        while commit is not None:
            out.append(commit)
            commit = self.get_commit(meta, commit["parents"][0]) if commit["parents"] else None
        return out

    def apply_commit(self, repo_type: str, repo_id: str, rev: str, ops: Iterable[tuple], title: str,
                     message: str, author: str, parent_commit: str | None = None) -> str:
        """Apply ops [("add", path, entry) | ("delete_file", path) | ("delete_folder", path)] on a branch/PR ref."""
        with self.lock:
            meta = self.require_repo(repo_type, repo_id)
            ref = self.ref_name(meta, rev)
            if ref is None:
                if _SHA_RE.match(rev):
                    raise HubError(400, f"Cannot commit to a commit sha ({rev}); use a branch", "RevisionNotFound")
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            if not (ref.startswith("refs/heads/") or ref.startswith("refs/pr/")):
                raise HubError(400, f"Cannot commit to {ref}: only branches and PR refs accept commits")
            head = meta["refs"][ref]
            if parent_commit is not None and parent_commit != head:
                raise HubError(412, f"A commit has happened since. Please refresh and try again. "
                                    f"(parentCommit {parent_commit} is not the head {head} of {ref})")
            tree = dict(self.get_commit(meta, head)["tree"])  # type: ignore[index]
            for op in ops:
                if op[0] == "add":
                    tree[op[1]] = op[2]
                elif op[0] == "delete_file":
                    if tree.pop(op[1], None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {op[1]}", "EntryNotFound")
                else:
                    prefix = op[1].rstrip("/") + "/"
                    gone = [p for p in tree if p.startswith(prefix)]
                    if not gone:
                        raise HubError(404, f"A folder with this name doesn't exist: {op[1]}", "EntryNotFound")
                    for p in gone:
                        del tree[p]
            sha = self._write_commit(meta, head, tree, title, message, author)
            meta["refs"][ref] = sha
            meta["lastModified"] = now_iso()
            self._save_repo(meta)
            return sha

    def create_ref(self, repo_type: str, repo_id: str, ref: str, start_rev: str | None) -> str:
        with self.lock:
            meta = self.require_repo(repo_type, repo_id)
            if ref in meta["refs"]:
                raise HubError(409, f"Reference {ref} already exists")
            sha = self.resolve(meta, start_rev or "main")["id"]
            meta["refs"][ref] = sha
            self._save_repo(meta)
            return sha

    def delete_ref(self, repo_type: str, repo_id: str, ref: str) -> None:
        with self.lock:
            meta = self.require_repo(repo_type, repo_id)
            if ref == "refs/heads/main":
                raise HubError(403, "Cannot delete the main branch")
            if meta["refs"].pop(ref, None) is None:
                raise HubError(404, f"Reference {ref} not found", "RevisionNotFound")
            self._save_repo(meta)

    # ---- discussions / pull requests -----------------------------------------------------------
    def create_discussion(self, repo_type: str, repo_id: str, title: str, description: str, author: str,
                          pull_request: bool, base_rev: str = "main", start_sha: str | None = None) -> dict:
        """A PR is the ref refs/pr/<num>, created at `start_sha` (default: head of the base branch)."""
        with self.lock:
            meta = self.require_repo(repo_type, repo_id)
            num = len(meta["discussions"]) + 1
            disc = {"num": num, "title": title, "description": description, "author": author,
                    "createdAt": now_iso(), "status": "open", "isPullRequest": pull_request}
            if pull_request:
                base_ref = self.ref_name(meta, base_rev)
                if base_ref is None or not base_ref.startswith("refs/heads/"):
                    raise HubError(404, f"Invalid rev id: {base_rev}", "RevisionNotFound")
                start = self.resolve(meta, start_sha or base_ref)["id"]
                disc.update(base=base_ref, start=start, ref=f"refs/pr/{num}")
                meta["refs"][f"refs/pr/{num}"] = start
            meta["discussions"].append(disc)
            self._save_repo(meta)
            return disc

    def get_discussion(self, meta: dict, num: int) -> dict:
        if not 1 <= num <= len(meta["discussions"]):
            raise HubError(404, f"Discussion {num} not found")
        return meta["discussions"][num - 1]

    def set_discussion_status(self, repo_type: str, repo_id: str, num: int, status: str) -> dict:
        with self.lock:
            meta = self.require_repo(repo_type, repo_id)
            disc = self.get_discussion(meta, num)
            disc["status"] = status
            self._save_repo(meta)
            return disc

    def merge_pr(self, repo_type: str, repo_id: str, num: int, author: str) -> str:
        """Replay the PR's changes (its head tree vs. where it started) onto the base branch head."""
        with self.lock:
            meta = self.require_repo(repo_type, repo_id)
            disc = self.get_discussion(meta, num)
            if not disc["isPullRequest"] or disc["status"] != "open":
                raise HubError(400, f"Discussion {num} is not an open pull request")
            start = self.get_commit(meta, disc["start"])["tree"]  # type: ignore[index]
            head = self.resolve(meta, disc["ref"])["tree"]
            ops: list[tuple] = [("add", p, e) for p, e in head.items() if start.get(p) != e]
            ops += [("delete_file", p) for p in start if p not in head]
            base_tree = self.resolve(meta, disc["base"])["tree"]
            ops = [op for op in ops if op[0] == "add" or op[1] in base_tree]
            sha = self.apply_commit(repo_type, repo_id, disc["base"], ops, f"Merge pull request #{num}",
                                    disc["title"], author)
            self.set_discussion_status(repo_type, repo_id, num, "merged")
            return sha
