"""The loopback Hub server, exercised with the REAL huggingface_hub client (and transformers/diffusers).

huggingface_hub reads HF_HUB_DISABLE_XET and HF_ENDPOINT once, at import time; tests/conftest.py sets the
session's transfer mode (Xet by default, plain LFS with HF_AO_TEST_TRANSFER=lfs). If nothing set HF_ENDPOINT yet
it defaults to a dead loopback port, so a call that forgets `endpoint=` fails fast instead of reaching
huggingface.co. These tests use their own server (fixture `srv`, not conftest's session `hub`), so every call
passes `endpoint=srv.url` explicitly; subprocesses (transformers, diffusers) get HF_ENDPOINT in their environment.
The protocol tests that must not depend on the session's mode speak it directly (raw HTTP, hf_xet).
Xet, multipart, the storage bridge, rate limits and fine-grained tokens: tests/test_testing_hubserver_paths.py.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")

import pytest  # noqa: E402
from huggingface_hub import (  # noqa: E402
    CommitOperationAdd,
    CommitOperationDelete,
    HfApi,
    hf_hub_download,
    snapshot_download,
)
from huggingface_hub.errors import (  # noqa: E402
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

# Self-tests of the test infrastructure: in the full run, not in `make test-fast`; the real client's side of the
# protocol differs by transfer mode, so they run in both.
pytestmark = [pytest.mark.slow, pytest.mark.transfer]

import hub_http  # noqa: E402

from publisher.testing.hubserver import HubServer, spawn_server  # noqa: E402

TOKENS = {"tok_alice": "alice", "tok_bob": "bob", "tok_carol": "carol"}
ORGS = {"acme": ["alice"]}
BIG = 10 * 1024 * 1024 + 123  # just over the LFS size threshold


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(tmp_path_factory.mktemp("hubdata"), tokens=TOKENS, orgs=ORGS) as server:
        yield server


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, srv: HubServer) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_ENDPOINT", srv.url)  # for anything that re-reads the environment
    monkeypatch.delenv("HF_TOKEN", raising=False)
    srv.clear_faults()


def api_for(srv: HubServer, token: str | bool = "tok_alice") -> HfApi:
    return HfApi(endpoint=srv.url, token=token)


def new_repo(srv: HubServer, name: str, **kwargs: object) -> str:
    repo_id = f"alice/{name}"
    api_for(srv).create_repo(repo_id, **kwargs)  # type: ignore[arg-type]
    return repo_id


def raw(srv: HubServer, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    url = path if path.startswith("http") else srv.url + path  # a full URL: the storage bridge's
    return hub_http.raw(url, method, body, headers)


# ---------------------------------------------------------------------------------------------


def test_create_repo_conflict_and_exist_ok(srv: HubServer) -> None:
    api = api_for(srv)
    url = api.create_repo("alice/created")
    assert url.repo_id == "alice/created"
    with pytest.raises(HfHubHTTPError) as exc:
        api.create_repo("alice/created")
    assert exc.value.response.status_code == 409
    assert api.create_repo("alice/created", exist_ok=True).repo_id == "alice/created"
    assert api.repo_exists("alice/created") and not api.repo_exists("alice/nothing-here")
    assert api.whoami()["name"] == "alice" and [o["name"] for o in api.whoami()["orgs"]] == ["acme"]


def test_upload_folder_lfs_and_downloads(srv: HubServer, tmp_path: Path) -> None:
    repo_id = new_repo(srv, "folder")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "README.md").write_text("---\nlicense: apache-2.0\ntags: [torchao, int8]\n---\n# Model\n")
    (src / "config.json").write_text('{"model_type": "gpt2"}')
    (src / "sub" / "notes.txt").write_text("hello")
    big = os.urandom(BIG)
    (src / "big.bin").write_bytes(big)
    for i in range(3):  # several LFS files: the client uploads them on concurrent threads
        (src / f"shard-{i}.safetensors").write_bytes(os.urandom(2048))
    api = api_for(srv)
    commit = api.upload_folder(repo_id=repo_id, folder_path=src)

    info = api.model_info(repo_id, files_metadata=True)
    assert info.sha == commit.oid
    assert info.card_data is not None and info.card_data.to_dict()["license"] == "apache-2.0"
    assert set(info.tags) >= {"torchao", "int8"}
    sib = {s.rfilename: s for s in info.siblings}
    assert sib["big.bin"].lfs is not None and sib["big.bin"].lfs.sha256 == hashlib.sha256(big).hexdigest()
    assert sib["big.bin"].size == BIG and sib["shard-0.safetensors"].lfs is not None
    assert sib["config.json"].lfs is None and sib["config.json"].size == len('{"model_type": "gpt2"}')

    files = api.list_repo_files(repo_id)
    assert {"big.bin", "config.json", "sub/notes.txt", "README.md", ".gitattributes"} <= set(files)
    top = {e.path: type(e).__name__ for e in api.list_repo_tree(repo_id)}
    assert top["sub"] == "RepoFolder" and "sub/notes.txt" not in top
    assert [e.path for e in api.list_repo_tree(repo_id, path_in_repo="sub")] == ["sub/notes.txt"]
    assert [e.path for e in api.get_paths_info(repo_id, ["config.json", "sub", "missing"])] == ["config.json", "sub"]

    path = hf_hub_download(repo_id, "big.bin", endpoint=srv.url, token="tok_alice", cache_dir=tmp_path / "c")
    assert Path(path).read_bytes() == big
    snap = Path(snapshot_download(repo_id, endpoint=srv.url, token="tok_alice", cache_dir=tmp_path / "c2"))
    assert (snap / "sub" / "notes.txt").read_text() == "hello" and (snap / "big.bin").stat().st_size == BIG


def test_resolve_headers_and_range(srv: HubServer) -> None:
    repo_id = new_repo(srv, "headers")
    api = api_for(srv)
    weights = os.urandom(4096)
    api.upload_file(path_or_fileobj=b"0123456789", path_in_repo="digits.txt", repo_id=repo_id)
    commit = api.upload_file(path_or_fileobj=weights, path_in_repo="w.safetensors", repo_id=repo_id)
    auth = {"Authorization": "Bearer tok_alice"}
    status, headers, _ = raw(srv, "HEAD", f"/{repo_id}/resolve/main/digits.txt", headers=auth)
    assert status == 200 and headers["X-Repo-Commit"] == commit.oid and "X-Xet-Hash" not in headers
    git_sha1 = hashlib.sha1(b"blob 10\0" + b"0123456789").hexdigest()
    assert headers["ETag"].strip('"') == git_sha1 and headers["Content-Length"] == "10"
    # An LFS file: 302 to the storage bridge (another origin), the metadata on the redirect itself.
    status, headers, _ = raw(srv, "HEAD", f"/{repo_id}/resolve/{commit.oid}/w.safetensors", headers=auth)
    assert status == 302 and headers["Location"].startswith(srv.bridge_url + "/_bridge/")
    assert headers["X-Linked-Etag"].strip('"') == hashlib.sha256(weights).hexdigest()
    assert headers["X-Linked-Size"] == "4096" and headers["X-Repo-Commit"] == commit.oid
    status, headers, body = raw(srv, "GET", f"/{repo_id}/resolve/main/digits.txt",
                                headers={**auth, "Range": "bytes=3-5"})
    assert status == 206 and body == b"345" and headers["Content-Range"] == "bytes 3-5/10"
    assert raw(srv, "GET", f"/{repo_id}/resolve/main/digits.txt", headers={"Range": "bytes=50-"})[0] == 416


def test_history_parent_commit_and_branches(srv: HubServer, tmp_path: Path) -> None:
    repo_id = new_repo(srv, "history")
    api = api_for(srv)
    first = api.upload_file(path_or_fileobj=b"v1", path_in_repo="f.txt", repo_id=repo_id)
    second = api.create_commit(repo_id, [CommitOperationAdd("f.txt", b"v2")], commit_message="v2",
                               parent_commit=first.oid)
    assert second.oid != first.oid
    with pytest.raises(HfHubHTTPError) as exc:  # main moved on: a stale parent is refused
        api.create_commit(repo_id, [CommitOperationAdd("f.txt", b"v3")], commit_message="v3",
                          parent_commit=first.oid)
    assert exc.value.response.status_code == 412
    commits = api.list_repo_commits(repo_id)
    assert [c.commit_id for c in commits[:2]] == [second.oid, first.oid] and len(commits) == 3  # + initial
    old = hf_hub_download(repo_id, "f.txt", revision=first.oid, endpoint=srv.url, token="tok_alice",
                          cache_dir=tmp_path / "c")
    assert Path(old).read_bytes() == b"v1"

    api.create_branch(repo_id, branch="dev")
    api.create_branch(repo_id, branch="dev", exist_ok=True)
    api.upload_file(path_or_fileobj=b"dev", path_in_repo="dev.txt", repo_id=repo_id, revision="dev")
    assert "dev.txt" in api.list_repo_files(repo_id, revision="dev")
    assert "dev.txt" not in api.list_repo_files(repo_id)
    assert {b.name for b in api.list_repo_refs(repo_id).branches} == {"main", "dev"}
    with pytest.raises(RevisionNotFoundError):
        api.model_info(repo_id, revision="no-such-branch")
    with pytest.raises(RemoteEntryNotFoundError):
        api.create_commit(repo_id, [CommitOperationDelete("missing.txt")], commit_message="rm")
    (tmp_path / "nested" / "deeper").mkdir(parents=True)
    (tmp_path / "nested" / "deeper" / "n.txt").write_text("n")
    api.upload_folder(repo_id=repo_id, folder_path=tmp_path / "nested", path_in_repo="copy")
    assert "copy/deeper/n.txt" in api.list_repo_files(repo_id)
    api.delete_folder("copy", repo_id=repo_id)
    assert not [f for f in api.list_repo_files(repo_id) if f.startswith("copy/")]


def test_pull_requests(srv: HubServer, tmp_path: Path) -> None:
    repo_id = new_repo(srv, "prs")
    api = api_for(srv)
    pr = api.create_commit(repo_id, [CommitOperationAdd("pr.txt", b"pr")], commit_message="Add pr.txt",
                           create_pr=True)
    assert pr.pr_num == 1 and pr.pr_url is not None and pr.pr_url.endswith(f"/{repo_id}/discussions/1")
    assert "pr.txt" not in api.list_repo_files(repo_id)
    assert "pr.txt" in api.list_repo_files(repo_id, revision="refs/pr/1")
    api.upload_file(path_or_fileobj=b"more", path_in_repo="more.txt", repo_id=repo_id, revision="refs/pr/1")
    got = hf_hub_download(repo_id, "more.txt", revision="refs/pr/1", endpoint=srv.url, token="tok_alice",
                          cache_dir=tmp_path / "c")
    assert Path(got).read_bytes() == b"more"

    manual = api.create_pull_request(repo_id, title="Manual PR")
    assert manual.num == 2 and manual.is_pull_request and manual.target_branch == "refs/heads/main"
    refs = api.list_repo_refs(repo_id, include_pull_requests=True)
    assert [r.ref for r in refs.pull_requests or []] == ["refs/pr/1", "refs/pr/2"]
    open_prs = [d.num for d in api.get_repo_discussions(repo_id, discussion_type="pull_request",
                                                        discussion_status="open")]
    assert open_prs == [2, 1]

    api.merge_pull_request(repo_id, 1)
    assert {"pr.txt", "more.txt"} <= set(api.list_repo_files(repo_id))
    api.change_discussion_status(repo_id, 2, new_status="closed")
    assert [d.status for d in api.get_repo_discussions(repo_id)] == ["closed", "merged"]


def test_private_repos_are_hidden(srv: HubServer) -> None:
    repo_id = new_repo(srv, "secret", private=True)
    api_for(srv).upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id=repo_id)
    for token in (False, "tok_bob"):
        with pytest.raises(RepositoryNotFoundError):
            api_for(srv, token).model_info(repo_id)
        assert not api_for(srv, token).repo_exists(repo_id)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(repo_id, "config.json", endpoint=srv.url, token=False, cache_dir=srv.data_dir / "c")
    assert api_for(srv).model_info(repo_id).private
    assert repo_id not in [m.id for m in api_for(srv, "tok_bob").list_models(author="alice")]
    org_repo = api_for(srv).create_repo("acme/org-private", private=True).repo_id  # alice is an acme member
    assert api_for(srv).repo_exists(org_repo) and not api_for(srv, "tok_bob").repo_exists(org_repo)


def test_invalid_token_is_401_everywhere(srv: HubServer) -> None:
    repo_id = new_repo(srv, "public")
    bad = api_for(srv, "not-a-token")
    for call in (bad.whoami, lambda: bad.model_info(repo_id), lambda: bad.list_repo_files(repo_id)):
        with pytest.raises(HfHubHTTPError) as exc:
            call()
        assert exc.value.response.status_code == 401
        assert not isinstance(exc.value, RepositoryNotFoundError)
    with pytest.raises(HfHubHTTPError) as exc:
        hf_hub_download(repo_id, ".gitattributes", endpoint=srv.url, token="not-a-token")
    assert exc.value.response.status_code == 401


def test_writing_needs_namespace_membership(srv: HubServer) -> None:
    repo_id = new_repo(srv, "owned")
    bob, anon = api_for(srv, "tok_bob"), api_for(srv, False)
    with pytest.raises(HfHubHTTPError) as exc:
        bob.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo_id)
    assert exc.value.response.status_code == 403 and "bob" in exc.value.response.headers["X-Error-Message"]
    for create in (lambda: bob.create_repo("alice/by-bob"), lambda: bob.create_repo("acme/by-bob"),
                   lambda: bob.create_branch(repo_id, branch="b")):
        with pytest.raises(HfHubHTTPError) as exc:
            create()
        assert exc.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as exc:
        anon.create_repo("alice/anon")
    assert exc.value.response.status_code == 401
    # As on the Hub, any authenticated reader may open a PR (but not push to main).
    assert bob.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo_id, create_pr=True).pr_num == 1


def test_gated_repo(srv: HubServer, tmp_path: Path) -> None:
    repo_id = new_repo(srv, "gated")
    api_for(srv).upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id=repo_id)
    srv.set_gated(repo_id, granted_users=["carol"])
    assert api_for(srv, "tok_bob").model_info(repo_id).gated == "auto"  # metadata stays visible
    for i, token in enumerate((False, "tok_bob")):
        with pytest.raises(GatedRepoError) as exc:
            hf_hub_download(repo_id, "config.json", endpoint=srv.url, token=token, cache_dir=tmp_path / f"d{i}")
        assert exc.value.response.status_code == (401 if token is False else 403)  # anonymous: 401, as on the Hub
    for i, token in enumerate(("tok_carol", "tok_alice")):  # granted user, and the owner
        hf_hub_download(repo_id, "config.json", endpoint=srv.url, token=token, cache_dir=tmp_path / f"ok{i}")
    # The admin endpoint does the same for a server running in another process.
    status, _, body = raw(srv, "POST", "/_admin/gated", json.dumps({"repo_id": repo_id, "gated": False}).encode())
    assert status == 200 and json.loads(body)["gated"] is False
    hf_hub_download(repo_id, "config.json", endpoint=srv.url, token="tok_bob", cache_dir=tmp_path / "open")


def test_commit_fault_is_seen_by_the_client(srv: HubServer) -> None:
    repo_id = new_repo(srv, "faulty")
    api = api_for(srv)
    srv.set_fault(commit_status=503, count=1)
    with pytest.raises(HfHubHTTPError) as exc:
        api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo_id)
    assert exc.value.response.status_code == 503
    assert len(api.list_repo_commits(repo_id)) == 1  # nothing landed
    api.upload_file(path_or_fileobj=b"x", path_in_repo="x.txt", repo_id=repo_id)  # the fault was used up
    # Same through the admin HTTP endpoint; "apply" lands the commit but still answers 500.
    spec = {"commit_status": 500, "count": 1, "apply": True}
    assert raw(srv, "POST", "/_admin/faults", json.dumps(spec).encode())[0] == 200
    with pytest.raises(HfHubHTTPError):
        api.upload_file(path_or_fileobj=b"y", path_in_repo="y.txt", repo_id=repo_id)
    assert "y.txt" in api.list_repo_files(repo_id) and srv.faults_fired["commit_status"] == 2


def _lfs_href(srv: HubServer, repo_id: str, data: bytes) -> str:
    oid = hashlib.sha256(data).hexdigest()
    body = {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
            "objects": [{"oid": oid, "size": len(data)}]}
    status, _, resp = raw(srv, "POST", f"/{repo_id}.git/info/lfs/objects/batch", json.dumps(body).encode(),
                          {"Authorization": "Bearer tok_alice", "Content-Type": "application/vnd.git-lfs+json"})
    assert status == 200
    return json.loads(resp)["objects"][0]["actions"]["upload"]["href"]


def test_dropped_upload_leaves_no_blob(srv: HubServer) -> None:
    repo_id = new_repo(srv, "drops")
    data = os.urandom(50_000)
    blob = srv.store.blob_path(hashlib.sha256(data).hexdigest())
    href = urlsplit(_lfs_href(srv, repo_id, data))
    srv.set_fault(drop_upload_after_bytes=1000, count=1)
    conn = http.client.HTTPConnection(href.hostname, href.port, timeout=10)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        conn.request("PUT", f"{href.path}?{href.query}", body=data)
        conn.getresponse()
    conn.close()
    assert not blob.exists() and not any((srv.store.root / "tmp").iterdir())
    # Wrong bytes for the signed oid: refused, nothing stored. Bad signature: 403.
    assert raw(srv, "PUT", f"{href.path}?{href.query}", os.urandom(50_000))[0] == 400
    assert raw(srv, "PUT", f"{href.path}?size=50000&sig=bad", data)[0] == 403
    assert not blob.exists()
    # A chunked body (Transfer-Encoding: chunked) with the right bytes is stored.
    conn = http.client.HTTPConnection(href.hostname, href.port, timeout=10)
    conn.request("PUT", f"{href.path}?{href.query}", body=iter([data[:7000], data[7000:]]), encode_chunked=True)
    assert conn.getresponse().status == 200 and blob.read_bytes() == data
    conn.close()
    if os.environ.get("HF_HUB_DISABLE_XET") == "1":  # the client's LFS path: it retries a dropped PUT (after ~1 s)
        srv.set_fault(drop_upload_after_bytes=1000, count=1)
        weights = os.urandom(20_000)
        api_for(srv).upload_file(path_or_fileobj=weights, path_in_repo="w.safetensors", repo_id=repo_id)
        assert srv.faults_fired["drop_upload"] == 2  # the raw drop above, then this one
        assert srv.store.blob_path(hashlib.sha256(weights).hexdigest()).read_bytes() == weights


def test_subprocess_persistence_and_from_pretrained(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    # Exercises the CLI's --token/--org/--gated parsing: acme/gated is gated as soon as it is created.
    spawn_kwargs = {"tokens": {"tok_alice": "alice", "tok_bob": "bob"}, "orgs": {"acme": ["alice"]},
                    "gated": {"acme/gated": []}}
    url, proc = spawn_server(data_dir, **spawn_kwargs)  # type: ignore[arg-type]
    try:
        api = HfApi(endpoint=url, token="tok_alice")
        api.create_repo("alice/tiny", private=True)
        config = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 16,
                  "n_positions": 8, "bos_token_id": 0, "eos_token_id": 0}
        api.upload_file(path_or_fileobj=json.dumps(config).encode(), path_in_repo="config.json",
                        repo_id="alice/tiny")
        scheduler = {"_class_name": "DDPMScheduler", "num_train_timesteps": 10}
        api.upload_file(path_or_fileobj=json.dumps(scheduler).encode(),
                        path_in_repo="scheduler/scheduler_config.json", repo_id="alice/tiny")
        head = api.upload_file(path_or_fileobj=os.urandom(3000), path_in_repo="model.safetensors",
                               repo_id="alice/tiny").oid
        api.create_repo("acme/gated")
        api.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id="acme/gated")
    finally:
        proc.kill()  # no clean shutdown: the state must already be on disk
        proc.wait()
    url, proc = spawn_server(data_dir, **spawn_kwargs)  # type: ignore[arg-type]
    try:
        api = HfApi(endpoint=url, token="tok_alice")
        assert api.model_info("alice/tiny").sha == head and len(api.list_repo_commits("alice/tiny")) == 4
        with pytest.raises(GatedRepoError):
            hf_hub_download("acme/gated", "config.json", endpoint=url, token="tok_bob", cache_dir=tmp_path / "c")
        env = {**os.environ, "HF_ENDPOINT": url, "HF_TOKEN": "tok_alice",
               "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        code = ("from transformers import AutoConfig\n"
                "c = AutoConfig.from_pretrained('alice/tiny')\n"
                "from diffusers import DDPMScheduler\n"
                "s = DDPMScheduler.from_pretrained('alice/tiny', subfolder='scheduler')\n"
                "print(c.model_type, c.n_layer, s.config.num_train_timesteps)\n")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["gpt2", "1", "10"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_discard_lfs_checks_records_and_drops_uploads(tmp_path: Path) -> None:
    """Benchmarks run the Hub with --discard-lfs (its storage is not the runner's disk on a real runner): an LFS
    upload is still checked and committed with its sha256, a wrong body is still refused, and its bytes are gone."""
    data = tmp_path / "hubdata"
    with HubServer(data, tokens=TOKENS, discard_lfs=True) as server:
        api = api_for(server)
        api.create_repo("alice/dropped")
        big = os.urandom(BIG)
        api.upload_file(path_or_fileobj=big, path_in_repo="big.bin", repo_id="alice/dropped")
        (sib,) = api.get_paths_info("alice/dropped", ["big.bin"])
        assert sib.lfs is not None and sib.lfs.sha256 == hashlib.sha256(big).hexdigest() and sib.size == BIG
        assert not list((data / "blobs").rglob(sib.lfs.sha256))  # recorded, not stored
        status, headers, _ = raw(server, "GET", "/alice/dropped/resolve/main/big.bin",
                                 headers={"Authorization": "Bearer tok_alice"})
        assert status == 302 and "X-Xet-Hash" not in headers  # dropped: not in the Xet store either
        status, _, body = raw(server, "GET", headers["Location"])
        assert status == 410 and b"--discard-lfs" in body
        api.upload_file(path_or_fileobj=big, path_in_repo="again.bin", repo_id="alice/dropped")  # known: no upload
        ask = {"operation": "upload", "objects": [{"oid": "0" * 64, "size": 3}]}
        status, _, body = raw(server, "POST", "/alice/dropped.git/info/lfs/objects/batch", json.dumps(ask).encode(),
                              {"Authorization": "Bearer tok_alice", "Content-Type": "application/json"})
        href = json.loads(body)["objects"][0]["actions"]["upload"]["href"]
        status, _, _ = raw(server, "PUT", href[len(server.url):], b"abc")
        assert status == 400  # the body does not hash to its oid: refused as before
        assert not (data / "discarded" / ("0" * 64 + ".json")).exists()
