"""Every base byte checked against the Hub's own hashes (publisher/io/integrity.py, downloads.py, verify/hashes.py).

A faulty link between the client and the loopback Hub (its body faults: a flipped byte with the right size and
ETag, a truncated body, a dropped connection, an ignored Range) must never end as a published repo: a corrupted
download or range read is refused naming the file and both hashes, nothing is created on the Hub, and a re-run
once the fault is gone publishes. ``verify TARGET`` checks the target's files and the recorded base's the same way.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import FAST_TRIES, IN_PROCESS, SKIP_EVAL_AND_MATRIX, TRANSFER, distinct_copy, download_fault, seed

TRIES = FAST_TRIES
WEIGHTS = "model.safetensors"


pytestmark = pytest.mark.usefixtures("fast_retries")  # conftest: FAST_TRIES tries, no faults left over


def _api() -> Any:
    from huggingface_hub import HfApi

    return HfApi(token="tok_alice")


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    return lines[0]


def _flipped_sha256(path: Path, at: int) -> str:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    return hashlib.sha256(data).hexdigest()


def _cached(repo_id: str, name: str) -> list[Path]:
    """Every snapshot entry of ``name`` in the session's Hugging Face cache for ``repo_id``."""
    root = Path(os.environ["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return list(root.glob(f"*/{name}")) if root.exists() else []


def _blobs(repo_id: str) -> set[str]:
    root = Path(os.environ["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}" / "blobs"
    return {p.name for p in root.iterdir()} if root.exists() else set()


# ---- unit: the hash primitives --------------------------------------------------------------------------
def test_hashed_reader_covers_gaps_and_refuses_out_of_order_reads() -> None:
    from publisher.errors import IntegrityError
    from publisher.io.integrity import FileHash, HashedReader

    data = bytes(range(256)) * 4000  # 1,024,000 bytes: the gaps below span several read blocks
    good = FileHash("sha256", hashlib.sha256(data).hexdigest(), len(data))
    r = HashedReader(io.BytesIO(data), good, "x")
    r.seek(0)
    assert r.read(8) == data[:8]
    r.seek(600_000)  # a gap (tensors nobody reads, padding): read and hashed, not handed out
    assert r.read(10) == data[600_000:600_010]
    r.finish()  # the rest of the file joins the hash
    bad = bytearray(data)
    bad[900_000] ^= 1  # a byte nobody reads still counts
    r = HashedReader(io.BytesIO(bytes(bad)), good, "shard.safetensors of a/b@0123")
    assert r.read(8) == data[:8]
    with pytest.raises(IntegrityError, match=f"shard.safetensors of a/b@0123: the bytes read by HTTP range have sha256 "
                                             f"{hashlib.sha256(bad).hexdigest()}, but the Hub reports {good.digest}"):
        r.finish()
    r = HashedReader(io.BytesIO(data), good, "x")
    r.read(100)
    r.seek(10)
    r.read(10)  # bytes handed out again after they were hashed
    with pytest.raises(IntegrityError, match="read out of order"):
        r.finish()
    r = HashedReader(io.BytesIO(data[:1000]), good, "x")
    with pytest.raises(IntegrityError, match="ended after 1000 bytes"):
        r.finish()


class CountingFile(io.BytesIO):
    """An in-memory file that counts the bytes handed out (what an HTTP range reader would fetch)."""

    fetched = 0

    def readinto(self, view: Any) -> int:  # type: ignore[override]
        n = super().readinto(view)
        self.fetched += n
        return n


def test_spilling_reader_takes_any_order_fetches_each_byte_once_and_hashes_in_file_order(tmp_path: Path) -> None:
    """Execution order is not file order (blocks.10 is stored before blocks.2): what is read ahead of the hash
    waits in the spill folder, each byte is fetched once, and the whole file is still compared with the Hub's hash."""
    import random

    from publisher.errors import IntegrityError
    from publisher.io.integrity import FileHash, SpillingHashedReader

    data = random.Random(0).randbytes(1_000_000)
    good = FileHash("sha256", hashlib.sha256(data).hexdigest(), len(data))
    pieces = [(a, a + 50_000) for a in range(8, 1_000_000 - 50_000, 50_000)]  # bytes [0, 8) and a tail nobody reads
    order = pieces[::-1][:5] + random.Random(1).sample(pieces[:-5], len(pieces) - 5)
    inner = CountingFile(data)
    r = SpillingHashedReader(inner, good, "x", tmp_path)
    for a, b in order:
        r.seek(a)
        assert r.read(b - a) == data[a:b]
    r.settle()  # the hashing thread has taken every read
    assert r.peak_spilled >= 5 * 50_000 and list(tmp_path.iterdir())  # the pieces read ahead wait on disk
    r.finish()  # the gaps nobody read are fetched here, once
    assert inner.fetched == len(data) and r.hashed == len(data)
    r.close()
    assert list(tmp_path.iterdir()) == []  # the spill file goes with the reader

    bad = bytearray(data)
    bad[pieces[-1][0] + 7] ^= 1  # in a piece read first, far ahead of the hash: it is checked from the spill
    r = SpillingHashedReader(CountingFile(bytes(bad)), good, "shard.safetensors of a/b@0123", tmp_path)
    for a, b in order:
        r.seek(a)
        r.read(b - a)
    with pytest.raises(IntegrityError, match="shard.safetensors of a/b@0123: the bytes read by HTTP range have sha256"):
        r.finish()
    r.close()

    r = SpillingHashedReader(CountingFile(data), good, "x", tmp_path)
    r.read(100)
    r.seek(10)
    r.read(10)  # behind the hash: fetched again, so not the bytes that were hashed
    with pytest.raises(IntegrityError, match="read out of order"):
        r.finish()
    r.close()
    assert list(tmp_path.iterdir()) == []


def test_the_spilling_readers_hashing_thread_hands_its_errors_to_the_caller(tmp_path: Path) -> None:
    """Hashing and spilling run on a thread of their own: what fails there (here: a spill folder that is gone)
    reaches the caller's next read or finish(), and close() leaves nothing behind."""
    from publisher.io.integrity import FileHash, SpillingHashedReader

    data = bytes(range(256)) * 4000
    good = FileHash("sha256", hashlib.sha256(data).hexdigest(), len(data))
    r = SpillingHashedReader(CountingFile(data), good, "x", tmp_path / "gone")
    r.seek(500_000)
    assert r.read(1000) == data[500_000:501_000]  # handed out at once; its spill fails on the hashing thread
    with pytest.raises(FileNotFoundError):
        r.finish()
    r.close()

    r = SpillingHashedReader(CountingFile(data), good, "x", tmp_path)
    for at in range(len(data) - 10_000, 0, -10_000):  # back to front: everything but the head is spilled
        r.seek(at)
        r.read(10_000)
    r.close()  # without finish(): the queued reads are dropped, the spilled pieces deleted
    assert list(tmp_path.iterdir()) == []


def test_git_blob_ids_and_the_state_file_form(tmp_path: Path) -> None:
    from publisher.io.integrity import FileHash, check_file, hash_file

    path = tmp_path / "config.json"
    path.write_bytes(b'{"a": 1}\n')
    # `git hash-object config.json` of these bytes
    blob = FileHash("git-sha1", hashlib.sha1(b"blob 9\0" + b'{"a": 1}\n').hexdigest(), 9)
    assert hash_file(path, blob) == blob.digest
    check_file(path, blob, "config.json")
    assert FileHash.from_json(blob.to_json()) == blob and blob.to_json() == {"git_blob": blob.digest, "size": 9}
    assert FileHash.from_json({"sha256": "AB", "size": 3}) == FileHash("sha256", "ab", 3)
    assert FileHash.from_json({"md5": "x", "size": 1}) is None and FileHash.from_json("x") is None


# ---- downloads -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.transfer
def test_a_flipped_byte_in_a_download_is_refused_then_a_rerun_publishes(cli: Any, hub: Any, tiny_llama_dir: Path,
                                                                        tmp_path: Path) -> None:
    base, target = "meta/integ-download", "alice/integ-download"
    model = distinct_copy(tiny_llama_dir, tmp_path / "model", salt=1)  # bytes no cache holds yet
    sha = seed(base, model, "tok_meta")
    size = (model / WEIGHTS).stat().st_size
    want = hashlib.sha256((model / WEIGHTS).read_bytes()).hexdigest()
    # same size, same ETag, one byte off; with Xet the run downloads a file again outside the shared store before it
    # gives up (downloads.py), so both downloads are damaged
    kind = download_fault(hub, "flip", f"/{base}/resolve/", at=size // 2, count=2 if TRANSFER == "xet" else 1)
    result = cli(base, "--quant", "int8wo", "--repo-id", target, *IN_PROCESS, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1, result.output
    line = _error_line(result.stderr)
    assert f"{WEIGHTS} of {base}@{sha[:12]}" in line and "download again" in line and f"but the Hub reports {want}" in line
    if TRANSFER == "lfs":
        assert f"sha256 {_flipped_sha256(model / WEIGHTS, size // 2)}, but" in line
    assert "removed from the cache" in line and not _api().repo_exists(target)
    assert _cached(base, WEIGHTS) == [] and want not in _blobs(base)  # the snapshot link and its blob are gone
    assert hub.faults_fired == {kind: 2 if TRANSFER == "xet" else 1}
    # the fault is gone: the same command downloads the file afresh and publishes, recording the base's hashes
    result = cli(base, "--quant", "int8wo", "--repo-id", target, "--json", *IN_PROCESS, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pushed"] and want in _blobs(base)
    state = json.loads(Path(_api().hf_hub_download(target, "hf_ao_publish.json")).read_text())
    assert state["base_files"][WEIGHTS] == {"sha256": want, "size": size}
    cfg = (model / "config.json").read_bytes()
    assert state["base_files"]["config.json"]["git_blob"] == hashlib.sha1(b"blob %d\0" % len(cfg) + cfg).hexdigest()


@pytest.mark.slow
@pytest.mark.skipif(TRANSFER != "xet", reason="huggingface_hub's shared blob store holds Xet downloads only")
def test_a_bad_shared_cache_copy_is_never_deleted_and_the_repo_gets_its_own(hub: Any, tiny_llama_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Two repos with the same file share one store entry in the cache. When its bytes are not the Hub's, the repair
    removes only this repo's links and downloads the file again outside the shared store; the checked copy is kept as
    this repo's own blob and replaces the shared file's content in place (never deleted: other repos' snapshots point
    at it, and now read the right bytes)."""
    from publisher.io.downloads import download
    from publisher.io.integrity import hashes_of

    model = distinct_copy(tiny_llama_dir, tmp_path / "model", salt=2)
    first, second = "meta/integ-shared-a", "meta/integ-shared-b"
    hashes = {}
    for repo in (first, second):
        sha = seed(repo, model, "tok_meta")
        hashes[repo] = (sha, hashes_of(_api().model_info(repo, revision=sha, files_metadata=True).siblings))
    want = hashes[first][1][WEIGHTS].digest
    xet_hash = _api().get_paths_info(first, [WEIGHTS])[0].xet_hash
    download_fault(hub, "flip", f"/{first}/resolve/")  # one damaged Xet download, published into the shared store
    folder = download(first, hashes[first][0], [WEIGHTS], hashes[first][1], "tok_meta")
    own = folder / WEIGHTS
    assert hashlib.sha256(own.read_bytes()).hexdigest() == want and not Path(os.readlink(own)).is_symlink()
    (store,) = (Path(os.environ["HF_HOME"]) / "hub" / "blobs").glob(f"*/{xet_hash}")
    assert hashlib.sha256(store.read_bytes()).hexdigest() == want  # repaired in place, not deleted
    # the other repo links the same shared file, which holds the right bytes now
    folder = download(second, hashes[second][0], [WEIGHTS], hashes[second][1], "tok_meta")
    assert hashlib.sha256((folder / WEIGHTS).read_bytes()).hexdigest() == want
    assert os.path.realpath(folder / WEIGHTS) == str(store.resolve())
    assert hub.faults_fired == {"xet_flip": 1}


@pytest.mark.slow
@pytest.mark.transfer
def test_truncated_and_dropped_downloads_are_retried_or_fail_in_one_line(cli: Any, hub: Any, tiny_llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    base = "meta/integ-short"
    model = distinct_copy(tiny_llama_dir, tmp_path / "model", salt=3)
    sha = seed(base, model, "tok_meta")
    # a short body on every try: retried, then one line (before any weight is read, nothing is written)
    hub.set_fault(truncate_body_at=10, match=f"/{base}/resolve/", count=TRIES)
    result = cli(base, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "a"), *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 1
    line = _error_line(result.stderr)
    assert f"of {base}@" in line and f"the body was cut short on each of {TRIES} tries" in line
    assert "re-run the same command" in line and not (tmp_path / "a").exists()
    hub.clear_faults()
    if TRANSFER == "xet":  # the weights come through hf_xet: a broken transfer on every try is one line too
        download_fault(hub, "truncate", f"/{base}/resolve/{sha}/{WEIGHTS}", count=TRIES)
        result = cli(base, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "x"), *SKIP_EVAL_AND_MATRIX)
        assert result.exit_code == 1
        line = _error_line(result.stderr)
        assert f"downloading {WEIGHTS} of {base}@{sha[:12]} through Xet failed on each of {TRIES} tries" in line
        assert "HF_HUB_DISABLE_XET=1" in line and not (tmp_path / "x").exists()
        hub.clear_faults()
    # one short body and one transfer cut in the middle: both retried, and the run verifies
    hub.set_fault(truncate_body_at=10, match=f"/{base}/resolve/")  # the first file read (config.json, at plan time)
    if TRANSFER == "xet":
        download_fault(hub, "truncate", f"/{base}/resolve/{sha}/{WEIGHTS}")
    else:
        hub.set_fault(drop_body_after_bytes=1000, match=f"/{base}/resolve/{sha}/{WEIGHTS}")  # the run reads at the sha
    result = cli(base, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "b"), "--json", *IN_PROCESS,
                 *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verified"]
    assert hub.faults_fired == {"truncate": 1, "xet_truncate" if TRANSFER == "xet" else "drop_body": 1}


@pytest.mark.slow
@pytest.mark.transfer
@pytest.mark.skipif(TRANSFER != "lfs", reason="an HTTP download's resume; a Xet download is reassembled by hf_xet")
def test_a_resumed_download_through_a_proxy_that_ignores_range_is_started_over(hub: Any) -> None:
    """huggingface_hub resumes a cut download with a Range once it wrote a 10 MiB chunk; a proxy that answers with the
    whole file then makes it start over (never append the wrong bytes), and the hash check confirms it."""
    from huggingface_hub import HfApi

    from publisher.io.downloads import download
    from publisher.io.integrity import hashes_of

    big, repo = os.urandom(11 * 2**20), "meta/integ-resume"
    api = HfApi(token="tok_meta")
    api.create_repo(repo, exist_ok=True)
    sha = api.upload_file(path_or_fileobj=big, path_in_repo="big.bin", repo_id=repo).oid
    hashes = hashes_of(api.model_info(repo, revision=sha, files_metadata=True).siblings)
    assert hashes["big.bin"].algo == "sha256"
    hub.set_fault(drop_body_after_bytes=10 * 2**20 + 4096, match=f"/{repo}/resolve/")
    hub.set_fault(ignore_range=True, match=f"/{repo}/resolve/")
    folder = download(repo, sha, ["big.bin"], hashes, None)
    assert (folder / "big.bin").read_bytes() == big
    assert hub.faults_fired == {"drop_body": 1, "ignore_range": 1}


# ---- --low-disk range reads (through the resolve redirect to the storage bridge) --------------------------
@pytest.mark.slow
@pytest.mark.transfer
def test_a_flipped_byte_in_a_range_read_stops_the_run_before_the_commit(cli: Any, hub: Any, tiny_llama_dir: Path) -> None:
    base, target = "meta/integ-range", "alice/integ-range"
    sha = seed(base, tiny_llama_dir, "tok_meta")
    size = (tiny_llama_dir / WEIGHTS).stat().st_size
    want = hashlib.sha256((tiny_llama_dir / WEIGHTS).read_bytes()).hexdigest()
    hub.set_fault(flip_byte_at=size - 5, match=f"/{base}/resolve/")  # the last tensor: read, quantized, uploaded...
    result = cli(base, "--quant", "int8wo", "--low-disk", "--repo-id", target, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1, result.output
    line = _error_line(result.stderr)
    assert f"{WEIGHTS} of {base}@{sha[:12]}: the bytes read by HTTP range have sha256 " in line
    assert f"{_flipped_sha256(tiny_llama_dir / WEIGHTS, size - 5)}, but the Hub reports {want}" in line
    assert "nothing was committed" in line and "download again" in line
    assert hub.faults_fired == {"flip": 1}
    assert not _api().repo_exists(target)  # ...but the repo this run created for the upload is gone again
    result = cli(base, "--quant", "int8wo", "--low-disk", "--repo-id", target, "--json", *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pushed"]


@pytest.mark.slow
@pytest.mark.transfer
def test_range_reads_resume_short_and_dropped_bodies_and_refuse_an_ignored_range(cli: Any, hub: Any,
                                                                                  tiny_llama_dir: Path,
                                                                                  tmp_path: Path) -> None:
    base, target = "meta/integ-ranges", "alice/integ-ranges"
    sha = seed(base, tiny_llama_dir, "tok_meta")
    weights = f"/{base}/resolve/"
    # a server (or proxy) that answers a Range with the whole file: refused at the first offset read, never misread
    hub.set_fault(ignore_range=True, match=weights, count=50)
    result = cli(base, "--quant", "int8wo", "--low-disk", "--repo-id", target, *SKIP_EVAL_AND_MATRIX, token="tok_alice")
    assert result.exit_code == 1, result.output
    line = _error_line(result.stderr)
    assert "ignored the HTTP Range header" in line and "--no-low-disk" in line and WEIGHTS in line
    assert not _api().repo_exists(target)
    hub.clear_faults()
    # short answers and a cut connection in the middle of tensors: each read resumes at its first missing byte
    hub.set_fault(truncate_body_at=7, match=f"{weights}{sha}/{WEIGHTS}", count=2)
    hub.set_fault(drop_body_after_bytes=100, match=f"{weights}{sha}/{WEIGHTS}", count=2)
    out = tmp_path / "out"
    result = cli(base, "--quant", "int8wo", "--low-disk", "--no-push", "--output-dir", str(out), "--json", *IN_PROCESS,
                 *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verified"]
    assert hub.faults_fired == {"truncate": 2, "drop_body": 2}


# ---- verify TARGET (a pipeline: component folders, model_index.json) ------------------------------------------
FLUX_WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def published(hub: Any, tiny_flux_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    from click.testing import CliRunner

    from publisher.cli import main

    # weights of its own: the fault test below leaves a bad copy in the cache, which no other test's files may share
    seed("bfl/integ-verify", distinct_copy(tiny_flux_dir, tmp_path_factory.mktemp("integ") / "flux", salt=4), "tok_bfl")
    os.environ["HF_TOKEN"] = "tok_alice"
    try:
        result = CliRunner().invoke(main, ["bfl/integ-verify", "--quant", "int8wo", "--repo-id", "alice/integ-verify",
                                           *IN_PROCESS, *SKIP_EVAL_AND_MATRIX], catch_exceptions=False)
    finally:
        del os.environ["HF_TOKEN"]
    assert result.exit_code == 0, result.output
    return "alice/integ-verify"


@pytest.mark.slow
@pytest.mark.transfer
def test_verify_target_refuses_a_flipped_byte_then_passes(cli: Any, hub: Any, published: str) -> None:
    import shutil

    shutil.rmtree(Path(os.environ["HF_HOME"]) / "hub" / f"models--{published.replace('/', '--')}", ignore_errors=True)
    # only this test downloads the published weights (with Xet: the first download and the one outside the store)
    download_fault(hub, "flip", f"/{FLUX_WEIGHTS}", at=-1, count=2 if TRANSFER == "xet" else 1)
    result = cli("verify", published, "--compat", "none")
    assert result.exit_code == 1, result.output
    line = _error_line(result.stderr)
    assert f"{FLUX_WEIGHTS} of {published}@" in line and "but the Hub reports" in line and "download again" in line
    assert "nothing was verified" in line and _cached(published, FLUX_WEIGHTS) == []
    result = cli("verify", published, "--json", "--compat", "none")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["passed"]
    assert "checked against the Hub's hashes" in result.stderr
    assert "checked against the hashes the target recorded" in result.stderr  # the base it re-quantized


@pytest.mark.slow
def test_verify_target_whose_recorded_base_hashes_differ_fails_naming_the_file(cli: Any, published: str) -> None:
    from huggingface_hub import CommitOperationAdd

    api = _api()
    state = json.loads(Path(api.hf_hub_download(published, "hf_ao_publish.json")).read_text())
    state["base_files"][FLUX_WEIGHTS]["sha256"] = "0" * 64  # as if it had been made from other bytes
    api.create_branch(published, branch="other-base", exist_ok=True)
    api.create_commit(published, [CommitOperationAdd("hf_ao_publish.json", json.dumps(state).encode())],
                      commit_message="tamper", revision="other-base")
    result = cli("verify", published, "--revision", "other-base", "--compat", "none")
    assert result.exit_code == 1, result.output
    line = _error_line(result.stderr)
    assert f"the base file {FLUX_WEIGHTS} of bfl/integ-verify@" in line and f"{published} records {'0' * 64}" in line
    assert "not made from this base" in line
