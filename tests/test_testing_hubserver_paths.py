"""The loopback Hub's real transfer paths, spoken directly (raw HTTP and hf_xet), whatever the session's mode:
Xet (write and read tokens, a false sha256 claim refused at the commit, Xet faults), multipart LFS (parts,
ETags, a completion that re-hashes the assembled object), the storage bridge (signed URLs, Range, no
Authorization), rate-limit headers, and fine-grained tokens with the permissions the loopback enforces.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_http import raw
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from publisher.testing.hubserver import HubServer

pytestmark = pytest.mark.slow

TOKENS = {"tok_alice": "alice", "tok_bob": "bob", "tok_fine": "alice", "tok_read": "alice", "tok_jobs": "alice"}
SCOPES: dict[str, Any] = {
    "tok_read": "read",
    "tok_fine": {"canReadGatedRepos": False, "global": [], "scoped": [
        {"entity": {"type": "user", "name": "alice"}, "permissions": ["repo.content.read", "repo.write"]},
        {"entity": {"type": "org", "name": "acme"}, "permissions": ["repo.content.read"]}]},
    "tok_jobs": {"global": [], "scoped": [{"entity": {"type": "user", "name": "alice"}, "permissions": ["job.write"]}]},
}
CHUNK = 100_000


AUTH = {"Authorization": "Bearer tok_alice"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(tmp_path_factory.mktemp("paths"), tokens=TOKENS, orgs={"acme": ["alice"]}, scopes=SCOPES,
                   multipart_threshold=2 * CHUNK, multipart_chunk=CHUNK) as server:
        yield server


@pytest.fixture(autouse=True)
def _clean(srv: HubServer) -> Iterator[None]:
    srv.clear_faults()
    yield
    srv.clear_faults()


def new_repo(srv: HubServer, name: str) -> str:
    HfApi(endpoint=srv.url, token="tok_alice").create_repo(f"alice/{name}")
    return f"alice/{name}"


def commit_lfs(srv: HubServer, repo_id: str, path: str, oid: str, size: int, rev: str = "main",
               token: str = "tok_alice") -> tuple[int, bytes]:
    lines = [{"key": "header", "value": {"summary": f"add {path}"}},
             {"key": "lfsFile", "value": {"path": path, "algo": "sha256", "oid": oid, "size": size}}]
    body = "\n".join(json.dumps(line) for line in lines).encode()
    status, _, resp = raw(f"{srv.url}/api/models/{repo_id}/commit/{rev}", "POST", body,
                          {"Authorization": f"Bearer {token}", "Content-Type": "application/x-ndjson"})
    return status, resp


def xet_upload(srv: HubServer, repo_id: str, data: bytes, claim: str | None = None) -> str:
    """Upload ``data`` through the Xet write token, as hf_xet does for huggingface_hub; returns the Xet hash."""
    import hf_xet

    status, headers, body = raw(f"{srv.url}/api/models/{repo_id}/xet-write-token/main", headers=AUTH)
    assert status == 200 and headers["X-Xet-Cas-Url"] == json.loads(body)["casUrl"]
    session = hf_xet.XetSession()
    with session.new_upload_commit(endpoint=json.loads(body)["casUrl"]) as commit:
        handle = commit.start_upload_bytes(data, sha256=claim or hf_xet.COMPUTE_SHA256)
    return str(handle.result().xet_info.hash)


def xet_download(srv: HubServer, repo_id: str, rev: str, xet_hash: str, size: int) -> bytes:
    """A file through a read token, as huggingface_hub's xet_get downloads it (hf_xet checks the size it wrote)."""
    import tempfile

    import hf_xet

    status, _, body = raw(f"{srv.url}/api/models/{repo_id}/xet-read-token/{rev}", headers=AUTH)
    assert status == 200
    with tempfile.TemporaryDirectory() as tmp:
        with hf_xet.XetSession().new_file_download_group(endpoint=json.loads(body)["casUrl"]) as group:
            group.start_download_file(hf_xet.XetFileInfo(xet_hash, size), f"{tmp}/out")
        return Path(f"{tmp}/out").read_bytes()


# ---- Xet -------------------------------------------------------------------------------------------
def test_a_xet_upload_is_held_to_its_sha256_claim(srv: HubServer) -> None:
    repo_id = new_repo(srv, "xet-claims")
    data = os.urandom(150_000)
    real = hashlib.sha256(data).hexdigest()
    xet_upload(srv, repo_id, data, claim="0" * 64)  # hf_xet records a preset claim without hashing anything
    status, body = commit_lfs(srv, repo_id, "w.safetensors", "0" * 64, len(data))
    assert status == 422 and real.encode() in body and b"false claim" in body
    xet_hash = xet_upload(srv, repo_id, data)  # computed by hf_xet while chunking: the true sha256
    status, body = commit_lfs(srv, repo_id, "w.safetensors", real, len(data))
    assert status == 200, body
    api = HfApi(endpoint=srv.url, token="tok_alice")
    (entry,) = api.get_paths_info(repo_id, ["w.safetensors"])
    assert entry.lfs is not None and entry.lfs.sha256 == real and entry.xet_hash
    assert xet_download(srv, repo_id, "main", entry.xet_hash, len(data)) == data
    assert entry.xet_hash == xet_hash  # the same bytes chunk to the same Xet file hash
    assert commit_lfs(srv, repo_id, "never.safetensors", "1" * 64, 10)[0] == 422  # nothing uploaded with that claim


def test_resolve_offers_xet_and_the_bridge_serves_the_same_bytes(srv: HubServer) -> None:
    repo_id = new_repo(srv, "xet-resolve")
    data = os.urandom(70_000)
    sha = HfApi(endpoint=srv.url, token="tok_alice").upload_file(
        path_or_fileobj=data, path_in_repo="m.safetensors", repo_id=repo_id).oid
    status, headers, _ = raw(f"{srv.url}/{repo_id}/resolve/main/m.safetensors", "HEAD", headers=AUTH)
    assert status == 302 and headers["X-Xet-Hash"]
    assert headers["Link"] == f'<{srv.url}/api/models/{repo_id}/xet-read-token/{sha}>; rel="xet-auth"'
    assert xet_download(srv, repo_id, sha, headers["X-Xet-Hash"], len(data)) == data
    bridge = headers["Location"]
    assert raw(bridge, headers={"Range": "bytes=10-19"})[2] == data[10:20]
    status, _, body = raw(bridge, headers={**AUTH, "Range": "bytes=10-19"})  # a signed URL takes no Hub token
    assert status == 400 and b"Authorization" in body
    assert raw(bridge.replace("sig=", "sig=0"))[0] == 403
    # a fault matched by the resolve path also fires on the bridge, with the Hub's rate-limit headers there too
    srv.set_fault(status=429, match="/resolve/main/m.safetensors", method="GET", ratelimit_reset=7)
    status, headers, _ = raw(bridge)
    assert status == 429 and headers["RateLimit"] == '"api";r=0;t=7'


def test_a_pull_request_upload_gets_a_write_token(srv: HubServer) -> None:
    repo_id = new_repo(srv, "xet-pr")
    status, _, body = raw(f"{srv.url}/api/models/{repo_id}/xet-write-token/None?create_pr=1",
                          headers={"Authorization": "Bearer tok_bob"})  # any reader may open a PR, as on the Hub
    assert status == 200 and json.loads(body)["casUrl"].startswith("local://")
    assert raw(f"{srv.url}/api/models/{repo_id}/xet-write-token/main", headers={"Authorization": "Bearer tok_bob"})[0] == 403


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_xet_faults_damage_what_a_read_token_serves(srv: HubServer, how: str) -> None:
    repo_id = new_repo(srv, f"xet-fault-{how}")
    data = os.urandom(90_000)
    HfApi(endpoint=srv.url, token="tok_alice").upload_file(path_or_fileobj=data, path_in_repo="x.safetensors",
                                                          repo_id=repo_id)
    (entry,) = HfApi(endpoint=srv.url, token="tok_alice").get_paths_info(repo_id, ["x.safetensors"])
    srv.set_fault(**{f"xet_{how}": True, "match": f"/{repo_id}/resolve/"})
    if how == "flip":  # hf_xet does not check chunk contents: one wrong byte arrives without an error
        got = xet_download(srv, repo_id, "main", entry.xet_hash, len(data))
        assert len(got) == len(data) and got != data
    else:
        with pytest.raises((OSError, RuntimeError)):
            xet_download(srv, repo_id, "main", entry.xet_hash, len(data))
    assert srv.faults_fired == {f"xet_{how}": 1}
    assert xet_download(srv, repo_id, "main", entry.xet_hash, len(data)) == data  # the next token: intact


# ---- multipart LFS -----------------------------------------------------------------------------------
def _batch(srv: HubServer, repo_id: str, oid: str, size: int) -> dict:
    ask = {"operation": "upload", "transfers": ["basic", "multipart"], "hash_algo": "sha256",
           "objects": [{"oid": oid, "size": size}]}
    status, _, body = raw(f"{srv.url}/{repo_id}.git/info/lfs/objects/batch", "POST", json.dumps(ask).encode(),
                          {**AUTH, "Content-Type": "application/vnd.git-lfs+json"})
    assert status == 200
    return json.loads(body)["objects"][0]["actions"]["upload"]


def test_multipart_upload_rehashes_the_assembled_object(srv: HubServer) -> None:
    repo_id = new_repo(srv, "multipart")
    data = os.urandom(CHUNK * 2 + 12_345)
    oid = hashlib.sha256(data).hexdigest()
    action = _batch(srv, repo_id, oid, len(data))
    header = action["header"]
    assert header["chunk_size"] == str(CHUNK) and sorted(k for k in header if k.isdigit()) == ["1", "2", "3"]
    parts = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    flipped = bytearray(parts[1])
    flipped[7] ^= 1
    etags = []
    for n, part in enumerate([parts[0], bytes(flipped), parts[2]], start=1):  # a byte flipped in part 2
        status, headers, _ = raw(header[str(n)], "PUT", part)
        assert status == 200
        etags.append(headers["ETag"])
    done = {"oid": oid, "parts": [{"partNumber": n, "etag": e} for n, e in enumerate(etags, start=1)]}
    status, _, body = raw(action["href"], "POST", json.dumps(done).encode(), {"Content-Type": "application/json"})
    assert status == 400 and b"assembled parts" in body and not srv.store.has_blob(oid)
    for n, part in enumerate(parts, start=1):  # the same upload, right this time
        etags[n - 1] = raw(header[str(n)], "PUT", part)[1]["ETag"]
    wrong = {"oid": oid, "parts": [{"partNumber": n, "etag": '"0"'} for n in (1, 2, 3)]}
    assert raw(action["href"], "POST", json.dumps(wrong).encode())[0] == 400  # ETags that do not match the parts
    for n, part in enumerate(parts, start=1):
        etags[n - 1] = raw(header[str(n)], "PUT", part)[1]["ETag"]
    done = {"oid": oid, "parts": [{"partNumber": n, "etag": e} for n, e in enumerate(etags, start=1)]}
    assert raw(action["href"], "POST", json.dumps(done).encode())[0] == 200 and srv.store.has_blob(oid, len(data))
    assert commit_lfs(srv, repo_id, "big.bin", oid, len(data))[0] == 200
    assert raw(header["1"].replace("sig=", "sig=0"), "PUT", parts[0])[0] == 403


def test_a_single_put_with_wrong_bytes_is_refused(srv: HubServer) -> None:
    repo_id = new_repo(srv, "single-put")
    data = os.urandom(50_000)
    oid = hashlib.sha256(data).hexdigest()
    href = _batch(srv, repo_id, oid, len(data))["href"]
    assert raw(href, "PUT", os.urandom(len(data)))[0] == 400 and not srv.store.has_blob(oid)
    assert commit_lfs(srv, repo_id, "w.bin", oid, len(data))[0] == 422  # never uploaded: nothing to commit


# ---- rate limits and tokens ---------------------------------------------------------------------------
def test_a_rate_limit_fault_carries_the_hubs_headers(srv: HubServer) -> None:
    srv.set_fault(status=429, match="/api/whoami-v2", ratelimit_reset=42)
    status, headers, _ = raw(f"{srv.url}/api/whoami-v2", headers=AUTH)
    assert status == 429 and headers["RateLimit"] == '"api";r=0;t=42' and "w=300" in headers["RateLimit-Policy"]


def test_fine_grained_tokens_are_reported_and_enforced(srv: HubServer) -> None:
    fine = HfApi(endpoint=srv.url, token="tok_fine")
    who = fine.whoami()["auth"]["accessToken"]
    assert who["role"] == "fineGrained" and who["fineGrained"]["scoped"][0]["permissions"][1] == "repo.write"
    assert HfApi(endpoint=srv.url, token="tok_read").whoami()["auth"]["accessToken"]["role"] == "read"
    fine.create_repo("alice/fine-ok")
    fine.upload_file(path_or_fileobj=b"{}", path_in_repo="config.json", repo_id="alice/fine-ok")
    for call in (lambda: fine.create_repo("acme/fine-no"),  # acme: read only
                 lambda: HfApi(endpoint=srv.url, token="tok_read").create_repo("alice/read-no"),
                 lambda: HfApi(endpoint=srv.url, token="tok_jobs").upload_file(
                     path_or_fileobj=b"x", path_in_repo="x.txt", repo_id="alice/fine-ok")):
        with pytest.raises(HfHubHTTPError) as exc:
            call()
        assert exc.value.response.status_code == 403 and "repo.write" in exc.value.response.headers["X-Error-Message"]
    status, _, body = raw(f"{srv.url}/api/jobs/alice", headers={"Authorization": "Bearer tok_fine"})
    assert status == 403 and b"job.write" in body
    assert raw(f"{srv.url}/api/jobs/alice", headers={"Authorization": "Bearer tok_jobs"})[0] == 200
    HfApi(endpoint=srv.url, token="tok_alice").create_repo("acme/private-one", private=True)
    assert HfApi(endpoint=srv.url, token="tok_fine").repo_exists("acme/private-one")  # repo.content.read on acme
    assert not HfApi(endpoint=srv.url, token="tok_jobs").repo_exists("acme/private-one")  # no read permission there


def test_a_fine_grained_token_reads_gated_repos_only_when_allowed(srv: HubServer, tmp_path: Path) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError

    HfApi(endpoint=srv.url, token="tok_bob").create_repo("bob/gated-one")
    HfApi(endpoint=srv.url, token="tok_bob").upload_file(path_or_fileobj=b"{}", path_in_repo="config.json",
                                                        repo_id="bob/gated-one")
    srv.set_gated("bob/gated-one", granted_users=["alice"])
    hf_hub_download("bob/gated-one", "config.json", endpoint=srv.url, token="tok_alice", cache_dir=tmp_path / "a")
    with pytest.raises(GatedRepoError) as exc:
        hf_hub_download("bob/gated-one", "config.json", endpoint=srv.url, token="tok_fine", cache_dir=tmp_path / "b")
    assert "canReadGatedRepos" in str(exc.value) or "gated" in str(exc.value)


def test_spawned_server_takes_scopes_and_multipart(tmp_path: Path) -> None:
    from publisher.testing.hubserver import spawn_server

    url, proc = spawn_server(tmp_path / "data", tokens={"tok_fine": "alice"}, scopes={"tok_fine": SCOPES["tok_fine"]},
                             multipart_threshold=1000)
    try:
        assert HfApi(endpoint=url, token="tok_fine").whoami()["auth"]["accessToken"]["role"] == "fineGrained"
        HfApi(endpoint=url, token="tok_fine").create_repo("alice/spawned")
        data = os.urandom(3000)
        ask = {"operation": "upload", "objects": [{"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}]}
        status, _, body = raw(f"{url}/alice/spawned.git/info/lfs/objects/batch", "POST", json.dumps(ask).encode(),
                              {"Authorization": "Bearer tok_fine", "Content-Type": "application/json"})
        assert status == 200 and "chunk_size" in json.loads(body)["objects"][0]["actions"]["upload"]["header"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_virtual_files_can_be_xet_backed_and_never_repeat_with_noise(srv: HubServer) -> None:
    """Benchmarks seed virtual files into the Xet store (``"xet": true``) so downloads take the Xet path; ``noise``
    data does not repeat, so Xet's chunking has nothing to deduplicate, as in a real checkpoint."""
    from publisher.testing.virtual import safetensors_file

    vf = safetensors_file([("w", (256, 1024))], seed=5, noise=True)
    data = b"".join(vf.read(0, vf.size - 1))
    assert data[len(vf.header):len(vf.header) + 4096] != data[len(vf.header) + 4096:len(vf.header) + 8192]
    repo_id = new_repo(srv, "virtual-xet")
    srv.app.add_virtual({"repo_id": repo_id, "xet": True,
                         "files": {"w.safetensors": {**vf.to_json(), "sha256": hashlib.sha256(data).hexdigest()}}})
    (entry,) = HfApi(endpoint=srv.url, token="tok_alice").get_paths_info(repo_id, ["w.safetensors"])
    assert entry.xet_hash and xet_download(srv, repo_id, "main", entry.xet_hash, vf.size) == data
