"""Reliability under injected faults, against the loopback Hub (issue 7).

Every test checks three things: the target repo is unchanged or complete afterwards, no local folder
passes for finished when it is not (a finished repo folder has README.md and no ".partial" suffix),
and a re-run completes. Retries are made fast through HF_AO_PUBLISH_RETRIES / _RETRY_DELAY.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import FAST_TRIES, IN_PROCESS, SKIP_EVAL_AND_MATRIX, TRANSFER, XET_DEFAULT_VERIFY

SMALL = ["--sample-steps", "2", "--sample-size", "64"]
TRIES = FAST_TRIES
EXCLUDE = "model.layers.0.mlp.down_proj"
EXCLUDE_FAULTS = "model.layers.1.mlp.up_proj"  # only used below: its weights are new to the Hub's LFS store
ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("fast_retries")  # conftest: FAST_TRIES tries, no faults left over


# ---- helpers -----------------------------------------------------------------------------------
def _api(token: str = "tok_alice", endpoint: str | None = None) -> Any:
    from huggingface_hub import HfApi

    return HfApi(token=token, endpoint=endpoint)


def _one_line_error(stderr: str, *needles: str) -> str:
    """The run failed with exactly one `Error: ...` line, no traceback, and that line says `needles`."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _finished_looking(root: Path) -> list[Path]:
    """Folders under `root` that pass for a finished repo folder: README.md inside, no .partial suffix."""
    if not root.exists():
        return []
    return [p.parent for p in root.rglob("README.md") if not any(part.endswith(".partial") for part in p.parent.parts)]


def _repo_files(repo_id: str, api: Any = None, revision: str | None = None) -> set[str]:
    return set((api or _api()).list_repo_files(repo_id, revision=revision))


def _head(repo_id: str, api: Any = None, revision: str | None = None) -> str:
    return (api or _api()).repo_info(repo_id, revision=revision).sha


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _assert_repo_matches_folder(repo_id: str, folder: Path, api: Any = None, revision: str | None = None) -> None:
    """The repo holds exactly the folder's files (+ .gitattributes), byte for byte."""
    api = api or _api()
    local = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert _repo_files(repo_id, api, revision) == local | {".gitattributes"}
    sha = _head(repo_id, api, revision)
    for name in sorted(local):
        got = api.hf_hub_download(repo_id, name, revision=sha)
        assert _sha256(got) == _sha256(folder / name), name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _admin(url: str, method: str = "GET", body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url}/_admin/faults", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as r:
        return json.loads(r.read())


def _cli_env(hf_home: Path, token: str | None, endpoint: str | None = None) -> dict[str, str]:
    # the session's transfer mode (HF_HUB_DISABLE_XET or not) is inherited; the run's temporary folders go beside
    # hf_home, in the test's own folder (what a killed CLI leaves there would otherwise stay in /tmp after the session)
    tmp = hf_home.parent / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HOME": str(hf_home), "TMPDIR": str(tmp),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("HF_TOKEN", None)
    if token:
        env["HF_TOKEN"] = token
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def _cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "publisher.cli", *args]


# ---- faults on a new target, then on the existing one -------------------------------------------------
@pytest.mark.slow
@pytest.mark.transfer
def test_hub_faults_leave_the_target_absent_or_complete_or_unchanged(cli: Any, hub: Any, llama_repo: str,
                                                                       tmp_path: Path) -> None:
    repo, api = "alice/rel-faults", _api()
    args = [llama_repo, "--quant", "int8wo", "--repo-id", repo, "--json", *SMALL, *IN_PROCESS, *SKIP_EVAL_AND_MATRIX]

    # 1. Every commit answers 500: exit 1 after the bounded tries; the repo created for the push is gone again.
    hub.set_fault(commit_status=500, count=1000)
    result = cli(*args, token="tok_alice")
    assert result.exit_code == 1
    _one_line_error(result.stderr, "the Hub kept failing (500", f"after {TRIES} tries", "try again later")
    assert hub.faults_fired == {"commit_status": TRIES}
    assert not api.repo_exists(repo)
    if result.stdout.strip():  # --json prints the partial outcome when publish.run attaches it
        assert json.loads(result.stdout)["pushed"] is False

    # 2. The re-run meets transient faults only: a 503 on the commit, then a commit that lands but whose answer
    #    is lost (503 after applying), and a connection dropped in the middle of an LFS upload (the safetensors;
    #    another --exclude than in step 1, whose identical weights the Hub would already hold and skip).
    #    It completes with exactly one commit: the lost answer is recognised on the Hub, not sent again.
    hub.clear_faults()
    hub.set_fault(commit_status=503, count=1)
    hub.set_fault(commit_status=503, apply=True, count=1)
    if TRANSFER == "lfs":
        hub.set_fault(drop_upload_after_bytes=1000, count=1)
        upload_fault = {"drop_upload": 1}
    else:  # through Xet the weights go to the CAS: the upload's first step, its write token, fails once instead
        hub.set_fault(status=503, match="/xet-write-token/", count=1)
        upload_fault = {"status": 1}
    out = tmp_path / "out"
    result = cli(*args, "--exclude", EXCLUDE_FAULTS, "--output-dir", str(out), token="tok_alice")
    assert result.exit_code == 0, result.output
    assert hub.faults_fired == {"commit_status": 2, **upload_fault}
    assert f"committing to {repo} failed (HTTP 503" in result.stderr and "retrying" in result.stderr
    assert "the previous try had succeeded on the Hub" in result.stderr
    data = json.loads(result.stdout)
    assert data["pushed"] and data["verified"] and data["commit"] == _head(repo)
    assert len(api.list_repo_commits(repo)) == 2  # the repo's initial commit + exactly one publication
    _assert_repo_matches_folder(repo, out)
    head, files = _head(repo), _repo_files(repo)

    # 3. A changed input (no --exclude: not a no-op) while every commit fails: the repo is left exactly as it was.
    hub.clear_faults()
    hub.set_fault(commit_status=500, count=1000)
    result = cli(*args, token="tok_alice")
    assert result.exit_code == 1
    _one_line_error(result.stderr, "the Hub kept failing (500")
    assert _head(repo) == head and _repo_files(repo) == files
    assert len(api.list_repo_commits(repo)) == 2
    assert "tok_alice" not in result.output


# ---- idempotency ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_rerun_is_a_noop_and_a_changed_input_makes_a_described_commit(cli: Any, llama_repo: str) -> None:
    repo, api = "alice/rel-idem", _api()
    args = [llama_repo, "--quant", "int8wo", "--repo-id", repo, "--json", *SMALL, *IN_PROCESS, *SKIP_EVAL_AND_MATRIX]
    first = cli(*args, token="tok_alice")
    assert first.exit_code == 0, first.output
    head = _head(repo)
    n_commits = len(api.list_repo_commits(repo))

    again = cli(*args, token="tok_alice")
    assert again.exit_code == 0, again.output
    assert f"{repo} is up to date" in again.stderr
    data = json.loads(again.stdout)
    assert data["up_to_date"] and not data["pushed"] and data["commit"] == head
    assert len(api.list_repo_commits(repo)) == n_commits

    changed = cli(*args, "--exclude", EXCLUDE, token="tok_alice")
    assert changed.exit_code == 0, changed.output
    data = json.loads(changed.stdout)
    assert data["pushed"] and data["commit"] != head
    commits = api.list_repo_commits(repo)
    assert len(commits) == n_commits + 1 and commits[0].commit_id == data["commit"]
    assert "Changed since the previous publication" in commits[0].message and "exclude" in commits[0].message
    state = json.loads(Path(api.hf_hub_download(repo, "hf_ao_publish.json", revision=data["commit"])).read_text())
    assert state["exclude"] == [EXCLUDE]
    last = cli(*args, "--exclude", EXCLUDE, token="tok_alice")
    assert last.exit_code == 0 and f"{repo} is up to date" in last.stderr
    assert len(api.list_repo_commits(repo)) == n_commits + 1


# ---- a local base ---------------------------------------------------------------------------------
QUIET = ["--eval-budget", "0", "--compat", "none"]  # neither the evaluation nor the matrix is the subject here


@pytest.mark.slow
def test_a_pushed_repo_of_a_local_base_holds_no_path_of_this_machine(cli: Any, tiny_flux_dir: Path, tmp_path: Path) -> None:
    """Every file of a repo made from a local folder, card, state file, verification.json and configs included, names
    the base by the folder's name and holds no path of the machine that made it (issue 37: a home folder on the Hub)."""
    import shutil

    base = tmp_path / "home" / "alice" / "models" / "my-flux"
    shutil.copytree(tiny_flux_dir, base)
    repo = "alice/rel-local-flux"
    result = cli(str(base), "--quant", "int8wo", "--components", "transformer,text_encoder_2", "--repo-id", repo,
                 *SMALL, *QUIET, token="tok_alice")  # the default verification: its report is pushed too
    assert result.exit_code == 0, result.output
    pushed = tmp_path / "pushed"
    _api().snapshot_download(repo, local_dir=pushed)
    files = {p.relative_to(pushed).as_posix(): p.read_bytes() for p in pushed.rglob("*")
             if p.is_file() and ".cache" not in p.relative_to(pushed).parts}
    assert {"README.md", "hf_ao_publish.json", "verification.json", "transformer/config.json"} <= set(files)
    for where in {str(tmp_path), str(tmp_path.resolve()), os.environ["HF_HOME"]}:
        assert [name for name, data in files.items() if where.encode() in data] == [], where
    card = files["README.md"].decode()
    assert "# my-flux (torchao int8wo)" in card and "quantization of the local model folder `my-flux`" in card
    assert "\nhf-ao-publish my-flux --quant int8wo --components transformer,text_encoder_2 --repo-id" in card
    assert json.loads(files["hf_ao_publish.json"])["base_model"] == "my-flux"
    assert json.loads(files["transformer/config.json"])["_name_or_path"] == "my-flux"  # as from_pretrained("my-flux")


@pytest.mark.slow
def test_a_moved_local_base_is_up_to_date_and_a_renamed_one_is_republished(cli: Any, tiny_llama_dir: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The state file names a local base by its folder's name: the same folder moved elsewhere is the same base (no
    commit); renamed, the card names it otherwise, so it is published again."""
    import shutil

    repo = "alice/rel-local-moved"
    shutil.copytree(tiny_llama_dir, tmp_path / "a" / "my-llama")
    monkeypatch.chdir(tmp_path / "a")
    args = ["--quant", "int8wo", "--repo-id", repo, "--json", *QUIET, *IN_PROCESS]
    first = cli("./my-llama", *args, token="tok_alice")
    assert first.exit_code == 0, first.output
    head = json.loads(first.stdout)["commit"]
    card = Path(_api().hf_hub_download(repo, "README.md")).read_text()
    assert "\nhf-ao-publish ./my-llama --quant int8wo --repo-id alice/rel-local-moved" in card  # as typed: relative
    (tmp_path / "b" / "c").mkdir(parents=True)
    shutil.move(tmp_path / "a" / "my-llama", tmp_path / "b" / "c" / "my-llama")
    moved = cli("../b/c/my-llama", *args, token="tok_alice")
    assert moved.exit_code == 0, moved.output
    assert json.loads(moved.stdout)["up_to_date"] and f"{repo} is up to date" in moved.stderr and _head(repo) == head
    (tmp_path / "b" / "c" / "my-llama").rename(tmp_path / "b" / "c" / "my-llama-v2")
    renamed = cli(str(tmp_path / "b" / "c" / "my-llama-v2"), *args, token="tok_alice")
    assert renamed.exit_code == 0, renamed.output
    assert json.loads(renamed.stdout)["pushed"] and _head(repo) != head
    commit = _api().list_repo_commits(repo)[0]
    assert commit.title == "Quantize my-llama-v2@local with torchao int8wo"
    assert "Changed since the previous publication: base_model." in commit.message


# ---- --create-pr ---------------------------------------------------------------------------------
@pytest.mark.transfer
@pytest.mark.slow
def test_create_pr_opens_one_pr_and_a_changed_rerun_updates_it(cli: Any, hub: Any, llama_repo: str) -> None:
    repo = "alice/rel-pr"
    api = _api()
    api.create_repo(repo)
    api.upload_file(path_or_fileobj=b"# existing\n", path_in_repo="README.md", repo_id=repo, commit_message="existing")
    main = _head(repo)
    args = [llama_repo, "--quant", "int8wo", "--repo-id", repo, "--create-pr", "--json", *SMALL, *IN_PROCESS, *SKIP_EVAL_AND_MATRIX]

    first = cli(*args, token="tok_alice")
    assert first.exit_code == 0, first.output
    data = json.loads(first.stdout)
    assert data["pr_url"] and "/discussions/" in data["pr_url"]
    num = int(data["pr_url"].rsplit("/", 1)[1])
    assert _head(repo) == main and _repo_files(repo) == {".gitattributes", "README.md"}  # main untouched
    prs = api.list_repo_refs(repo, include_pull_requests=True).pull_requests
    assert [r.ref for r in prs] == [f"refs/pr/{num}"] and prs[0].target_commit == data["commit"]
    assert "model.safetensors" in _repo_files(repo, revision=f"refs/pr/{num}")

    second = cli(*args, "--exclude", EXCLUDE, token="tok_alice")
    assert second.exit_code == 0, second.output
    data2 = json.loads(second.stdout)
    assert data2["pr_url"] == data["pr_url"]  # the same PR, updated
    prs = api.list_repo_refs(repo, include_pull_requests=True).pull_requests
    assert [r.ref for r in prs] == [f"refs/pr/{num}"] and prs[0].target_commit == data2["commit"] != data["commit"]
    pr_commits = api.list_repo_commits(repo, revision=f"refs/pr/{num}")
    assert [c.commit_id for c in pr_commits[:2]] == [data2["commit"], data["commit"]]
    assert _head(repo) == main
    open_prs = [d for d in api.get_repo_discussions(repo, discussion_type="pull_request") if d.status == "open"]
    assert [d.num for d in open_prs] == [num]


# ---- the Hub goes away in the middle of the push; and the token is never written -------------------
@pytest.mark.transfer
@pytest.mark.slow
def test_hub_stopped_mid_commit_then_rerun_completes_and_token_is_never_written(
        tiny_llama_dir: Path, tmp_path: Path) -> None:
    from publisher.testing.hubserver import spawn_server

    secret = "hf_reliability_" + secrets.token_hex(16)  # distinctive, so a scan for its bytes means something
    tokens = {secret: "alice", "tok_meta": "meta"}
    data_dir, port = tmp_path / "hub-data", _free_port()
    url, server = spawn_server(data_dir, tokens, port=port)
    try:
        seeder = _api("tok_meta", url)
        seeder.create_repo("meta/tiny-llama")
        seeder.upload_folder(repo_id="meta/tiny-llama", folder_path=tiny_llama_dir, commit_message="seed")
        _admin(url, "POST", {"delay_s": 120, "match": "/commit/", "count": 1})

        hf_home = tmp_path / "hf_home"
        env = {**_cli_env(hf_home, secret, url), "HF_AO_PUBLISH_RETRIES": str(TRIES),
               "HF_AO_PUBLISH_RETRY_DELAY": "0.1"}
        repo, out1, out2 = "alice/rel-outage", tmp_path / "out1", tmp_path / "out2"
        cmd = _cli_cmd("meta/tiny-llama", "--quant", "int8wo", "--repo-id", repo, *SMALL, *SKIP_EVAL_AND_MATRIX)
        with open(tmp_path / "run1.out", "w+") as so, open(tmp_path / "run1.err", "w+") as se:
            # the first run's subject is the outage at its commit: it verifies in process (the re-run below keeps the
            # default mode, the users' path end to end, in the Xet session: helpers.XET_DEFAULT_VERIFY)
            cli_proc = subprocess.Popen([*cmd, "--output-dir", str(out1), *IN_PROCESS], env=env, stdout=so, stderr=se)
            try:
                deadline = time.monotonic() + 180
                while _admin(url)["fired"].get("delay", 0) < 1:  # the CLI is now waiting on its commit
                    assert cli_proc.poll() is None, Path(se.name).read_text()
                    assert time.monotonic() < deadline, "the CLI never reached the commit"
                    time.sleep(0.1)
                server.kill()
                server.wait(timeout=30)
                rc = cli_proc.wait(timeout=120)
            finally:
                if cli_proc.poll() is None:
                    cli_proc.kill()
                    cli_proc.wait()
        run1_out, run1_err = (tmp_path / "run1.out").read_text(), (tmp_path / "run1.err").read_text()
        assert rc == 1, run1_err
        _one_line_error(run1_err, f"cannot reach the Hub at {url}")

        url2, server = spawn_server(data_dir, tokens, port=port)
        assert url2 == url
        api = _api(secret, url)
        # the repo was created before the commit and could not be deleted while the Hub was down: it may
        # exist, but holds nothing of ours
        assert not api.repo_exists(repo) or _repo_files(repo, api) == {".gitattributes"}

        run2 = subprocess.run([*cmd, "--output-dir", str(out2), "--json", *XET_DEFAULT_VERIFY], env=env,
                              capture_output=True, text=True, timeout=300)
        assert run2.returncode == 0, run2.stderr
        data = json.loads(run2.stdout)
        assert data["pushed"] and data["verified"] and data["commit"] == _head(repo, api)
        _assert_repo_matches_folder(repo, out2, api)
        assert {"README.md", "model.safetensors", "verification.json", "hf_ao_publish.json"} <= _repo_files(repo, api)
        card = Path(api.hf_hub_download(repo, "README.md", revision=data["commit"])).read_text()
        assert "torchao" in card and "meta/tiny-llama" in card

        # The token never appears in any output or any file either run wrote (cards, JSON, reports, caches).
        needle = secret.encode()
        for text in (run1_out, run1_err, run2.stdout, run2.stderr):
            assert secret not in text
        for root in (out1, out2, hf_home):
            for path in root.rglob("*"):
                if path.is_file():
                    assert needle not in path.read_bytes(), path
    finally:
        server.kill()
        server.wait(timeout=30)


# ---- the CLI is killed during quantization ---------------------------------------------------------
@pytest.mark.slow
def test_sigkill_during_quantization_leaves_nothing_finished_and_rerun_completes(
        cli: Any, llama_repo: str, tmp_path: Path) -> None:
    out = tmp_path / "work" / "out"
    cmd = _cli_cmd(llama_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(out), *SMALL, *SKIP_EVAL_AND_MATRIX)
    proc = subprocess.Popen(cmd, env=_cli_env(tmp_path / "hf_home", None), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not list((tmp_path / "work").rglob("*.partial")):
            assert proc.poll() is None, "the CLI ended before quantizing"
            assert time.monotonic() < deadline, "no .partial folder appeared"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert _finished_looking(tmp_path / "work") == []

    # Same --output-dir again: the interrupted run's unfinished folder is discarded, never reused as finished.
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(out), "--json", *SMALL, *IN_PROCESS,
                 *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verified"] is True
    assert _finished_looking(tmp_path / "work") == [out]
    assert list((tmp_path / "work").rglob("*.partial")) == []
    assert (out / "model.safetensors").is_file() and (out / "hf_ao_publish.json").is_file()


# ---- the output disk fills --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["auto", "library"])  # the streaming writer and save_pretrained fail differently
def test_disk_full_while_writing_weights_is_one_line_and_pushes_nothing(hub: Any, tiny_llama_dir: Path, tmp_path: Path,
                                                                         engine: str) -> None:
    limit = 100_000  # above every small file of the tiny llama, below its quantized weights

    def small_files_only() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    repo, out = f"alice/rel-diskfull-{engine}", tmp_path / "out"
    proc = subprocess.run(_cli_cmd(str(tiny_llama_dir), "--quant", "int8wo", "--repo-id", repo, "--engine", engine,
                                   "--output-dir", str(out), *SMALL, *SKIP_EVAL_AND_MATRIX),
                          env=_cli_env(tmp_path / "hf_home", "tok_alice"), capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files_only)
    assert proc.returncode == 1, proc.stderr
    _one_line_error(proc.stderr, "no space left", "free disk space or point --output-dir at a larger disk")
    assert _finished_looking(tmp_path) == []
    assert list(tmp_path.rglob("*.partial")) == []
    assert not _api().repo_exists(repo)
    assert "tok_alice" not in proc.stdout + proc.stderr


# ---- unsafe file names in a base repo ---------------------------------------------------------------
def test_unsafe_base_file_names_are_refused_before_download(cli: Any, hub: Any, tiny_llama_dir: Path,
                                                            tmp_path: Path) -> None:
    from huggingface_hub import CommitOperationAdd

    from publisher.errors import SourceError
    from publisher.handoffs.plan import Component, Source
    from publisher.stages.planning import _base_files

    # A repo cannot even hold such a name: the client refuses it, and so does the (loopback) Hub.
    with pytest.raises(ValueError):
        CommitOperationAdd(path_in_repo="../evil.json", path_or_fileobj=b"{}")
    api = _api("tok_meta")
    api.create_repo("meta/rel-unsafe", exist_ok=True)
    payload = (json.dumps({"key": "header", "value": {"summary": "evil"}}) + "\n"
               + json.dumps({"key": "file", "value": {"path": "../evil.json", "content": "e30=", "encoding": "base64"}}))
    req = urllib.request.Request(f"{hub.url}/api/models/meta/rel-unsafe/commit/main", data=payload.encode(),
                                 method="POST", headers={"Authorization": "Bearer tok_meta",
                                                         "Content-Type": "application/x-ndjson"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10)
    assert refused.value.code == 400

    # So the way in is a name the repo points at: a sharded checkpoint's index naming shards outside the folder.
    local = tmp_path / "base"
    local.mkdir()
    comp = Component(name="", library="transformers", class_name="LlamaForCausalLM", quantize=True,
                     weight_files=("model.safetensors.index.json",))
    for evil in ("../evil.safetensors", "/tmp/evil.safetensors", "sub/../../evil.safetensors"):
        (local / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": evil}}))
        src = Source(model_id=str(local), repo_id=None, local_dir=local, revision=None, sha=None,
                     sizes={"config.json": 2, "model.safetensors.index.json": 40, evil: 10})
        with pytest.raises(SourceError, match="unsafe file name"):
            _base_files(src, "transformers", [comp], None)

    # End to end on the Hub: a base whose index points outside the repo fails in the plan, before any download.
    bad = tmp_path / "bad-llama"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((tiny_llama_dir / name).read_bytes())
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "../../evil.safetensors"}}))
    api.upload_folder(repo_id="meta/rel-unsafe", folder_path=bad, commit_message="index pointing outside")
    out = tmp_path / "out"
    result = cli("meta/rel-unsafe", "--quant", "int8wo", "--no-push", "--output-dir", str(out), *SMALL)
    assert result.exit_code == 1
    _one_line_error(result.stderr, "../../evil.safetensors")
    assert not out.exists()
    hf_home = Path(os.environ["HF_HOME"])
    assert not [p for p in hf_home.parent.rglob("evil.safetensors")]


# ---- which errors are retried ---------------------------------------------------------------------------
def test_retry_classifies_errors_and_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    from publisher.io import hub

    def http(status: int, headers: dict[str, str] | None = None) -> HfHubHTTPError:
        response = httpx2.Response(status, headers=headers, request=httpx2.Request("POST", "http://127.0.0.1/x"))
        return HfHubHTTPError(f"{status} error", response=response)

    request = httpx2.Request("POST", "http://127.0.0.1/x")
    for exc in (http(500), http(502), http(503), http(429), httpx2.ConnectError("refused", request=request),
                httpx2.RemoteProtocolError("dropped", request=request), httpx2.ReadTimeout("slow", request=request),
                ConnectionResetError()):
        assert hub.is_transient(exc), exc
    for exc in (http(400), http(401), http(403), http(404), http(409), http(412), OfflineModeIsEnabled("offline"),
                httpx2.UnsupportedProtocol("ftp://", request=request), ValueError("bug")):
        assert not hub.is_transient(exc), exc
    assert hub.retry_after(http(429, {"Retry-After": "7"})) == 7.0 and hub.retry_after(http(503)) == 0.0

    monkeypatch.setenv("HF_AO_PUBLISH_RETRY_DELAY", "0")
    calls: list[int] = []

    def flaky(fail: BaseException, times: int) -> Any:
        def fn() -> str:
            calls.append(1)
            if len(calls) <= times:
                raise fail
            return "ok"
        return fn

    assert hub.call(flaky(http(503), TRIES - 1), what="t") == "ok" and len(calls) == TRIES
    calls.clear()
    with pytest.raises(HfHubHTTPError):
        hub.call(flaky(http(503), TRIES), what="t")
    assert len(calls) == TRIES  # bounded
    calls.clear()
    with pytest.raises(HfHubHTTPError):
        hub.call(flaky(http(412), 1), what="t")
    assert len(calls) == 1  # permanent: never retried
    calls.clear()
    # the check before a retry ends the loop when the first try had landed after all
    assert hub.call(flaky(http(503), 1), what="t", check=lambda: "landed") == "landed" and len(calls) == 1


def test_a_429_with_the_hubs_ratelimit_header_waits_out_the_window(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    from publisher.io import hub

    def limited(reset: int, left: int = 0) -> HfHubHTTPError:
        headers = {"RateLimit": f'"api";r={left};t={reset}', "RateLimit-Policy": '"fixed window";"api";q=500;w=300'}
        response = httpx2.Response(429, headers=headers, request=httpx2.Request("GET", "http://127.0.0.1/api/x"))
        return HfHubHTTPError("429 Too Many Requests", response=response)

    assert hub.rate_limit_wait(limited(42)) == (43.0, "api")  # one second past the reset
    assert hub.rate_limit_wait(limited(42, left=3)) is None and hub.rate_limit_wait(ValueError()) is None
    assert hub.rate_limit_wait(limited(3000)) == (hub.MAX_RATE_WAIT_S, "api")  # bounded
    monkeypatch.setenv("HF_AO_PUBLISH_MAX_RATE_WAIT", "0.2")
    monkeypatch.setenv("HF_AO_PUBLISH_RETRY_DELAY", "0")
    slept: list[float] = []
    monkeypatch.setattr(hub.time, "sleep", slept.append)
    calls: list[int] = []

    def once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise limited(250)
        return "ok"

    with caplog.at_level("INFO", logger="publisher"):
        assert hub.call(once, what="reading x") == "ok"
    assert slept == [0.2]
    (line,) = [r.getMessage() for r in caplog.records if "rate limit" in r.getMessage()]
    assert line.startswith("reading x: the Hub's 'api' rate limit is used up; waiting 0 s")


@pytest.mark.slow
def test_a_rate_limited_api_call_during_a_run_waits_and_the_run_goes_on(cli: Any, hub: Any, llama_repo: str,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    hub.set_fault(status=429, match=f"/api/models/{llama_repo}", ratelimit_reset=1, count=1)
    t0 = time.monotonic()
    result = cli(llama_repo, "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "out"), "--json", *IN_PROCESS,
                 *SKIP_EVAL_AND_MATRIX)
    assert result.exit_code == 0, result.output
    assert hub.faults_fired == {"status": 1} and time.monotonic() - t0 >= 2  # reset (1 s) + 1 s margin
    assert [line for line in result.stderr.splitlines() if "rate limit is used up" in line][0].startswith(
        f"reading {llama_repo}: the Hub's 'api' rate limit is used up; waiting 2 s")


def test_messages_for_unreachable_hub_and_full_disk() -> None:
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    from publisher.errors import QuantizeError
    from publisher.messages import describe

    request = httpx2.Request("GET", "http://127.0.0.1/x")
    try:
        raise LocalEntryNotFoundError("cannot find the file in the cache") from httpx2.ConnectError("refused", request=request)
    except LocalEntryNotFoundError as exc:
        assert "cannot reach the Hub" in describe(exc)[0]
    for err in (OSError(28, "No space left on device", "/out/model.safetensors"), OSError(27, "File too large")):
        try:
            raise QuantizeError(f"writing the quantized folder failed: {err}") from err
        except QuantizeError as exc:
            message, code = describe(exc)
            assert code == 1 and message.startswith("no space left") and "--output-dir at a larger disk" in message
    assert describe(RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'))
    # the Hub's own full disk (a 507/500 answer) is the Hub's problem, not a local one
    response = httpx2.Response(500, request=request)
    message, _ = describe(HfHubHTTPError("500: No space left on device", response=response))
    assert not message.startswith("no space left")
