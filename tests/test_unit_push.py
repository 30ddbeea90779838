"""The push from a prebuilt repo folder (written here by hand) to the loopback Hub: no quantization, no verification run.

One commit that holds exactly the folder's bytes (the LFS objects by their sha256, the small files by their git blob
id), nothing pushed for a report that did not pass, no new commit when nothing changed, and a pull request on request.
Marked ``transfer``: they run with Xet (the default) and again with plain LFS (HF_AO_TEST_TRANSFER=lfs).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import unit_fixtures as uf

pytestmark = pytest.mark.transfer
TOKEN = "tok_alice"


@pytest.fixture(scope="module", autouse=True)
def _libraries() -> None:
    """torch, torchao (the recipe of the fixture folder) and the Hub client imported once (seconds) before the first
    test: the tests measure the push, not the imports."""
    import huggingface_hub  # noqa: F401
    import safetensors.torch  # noqa: F401

    from publisher import recipes

    recipes.get("int8wo")


@pytest.fixture
def repo_id(hub: Any) -> str:
    return f"alice/unit-push-{uuid.uuid4().hex[:8]}"


def _folder(root: Path, fingerprint: str = "fp-1") -> tuple[Path, Any, dict[str, Any]]:
    """(a repo folder as the card stage leaves it, its passing report, its state)."""
    from publisher.stages.push import write_repo_files

    folder = root / "repo"
    _, artifacts = uf.lm_publish(folder)
    report = uf.report_for(artifacts, uf.passing_results(artifacts))
    (folder / "README.md").write_text("---\nbase_model: meta/tiny-llama\n---\n\n# tiny-llama (torchao int8wo)\n")
    state = {"fingerprint": fingerprint, "recipe": "int8wo", "base": {"repo_id": "meta/tiny-llama", "sha": uf.SHA}}
    write_repo_files(folder, state)
    report.write(folder)
    return folder, report, state


def _push(folder: Path, report: Any, state: dict[str, Any], repo_id: str, **options: Any) -> Any:
    from publisher.stages.push import push

    return push(folder, report, repo_id=repo_id, token=TOKEN, private=options.pop("private", False),
                create_pr=options.pop("create_pr", False), message=options.pop("message", "Quantize meta/tiny-llama"),
                description=options.pop("description", "First publication."), state=state, **options)


def _local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _commits(repo_id: str, revision: str | None = None) -> list[Any]:
    from huggingface_hub import HfApi

    return HfApi(token=TOKEN).list_repo_commits(repo_id, revision=revision)


def test_push_creates_the_repo_in_one_commit_with_the_folders_bytes(tmp_path: Path, repo_id: str) -> None:
    from huggingface_hub import HfApi, hf_hub_download

    from publisher.handoffs.statefile import STATE_FILE
    from publisher.verify.commit_hashes import check_commit, git_blob_id

    folder, report, state = _folder(tmp_path)
    api = HfApi(token=TOKEN)
    assert not api.repo_exists(repo_id)
    result = _push(folder, report, state, repo_id, description="First publication.\n\nMade with hf-ao-publish.")
    assert result.created and not result.up_to_date and result.pr_url is None
    assert result.url.endswith(f"/{repo_id}") and result.commit == api.repo_info(repo_id).sha
    commits = _commits(repo_id)
    ours = [c for c in commits if c.title == "Quantize meta/tiny-llama"]
    assert len(ours) == 1 and commits[0].commit_id == result.commit  # every file in the one commit, at the head
    assert "First publication.\n\nMade with hf-ao-publish." in ours[0].message
    local = _local_files(folder)
    assert set(local) == {".gitattributes", STATE_FILE, "README.md", "config.json", "model.safetensors",
                          "tokenizer.json", "verification.json"}
    tree: dict[str, Any] = {e.path: e for e in api.list_repo_tree(repo_id, recursive=True, revision=result.commit)}
    assert set(tree) == set(local)
    weights = tree["model.safetensors"]
    assert weights.lfs is not None and weights.lfs.sha256 == hashlib.sha256(local["model.safetensors"]).hexdigest()
    assert weights.size == len(local["model.safetensors"])
    for small in ("README.md", "config.json", STATE_FILE, "verification.json"):
        assert tree[small].lfs is None and tree[small].blob_id == git_blob_id(local[small])
    for path, data in local.items():
        assert Path(hf_hub_download(repo_id, path, revision=result.commit, token=TOKEN)).read_bytes() == data
    # what push hashed before the upload is what the commit holds (the post-push check of a publish)
    assert set(result.files) == set(local) and result.files["model.safetensors"].sha256 == weights.lfs.sha256
    assert check_commit(repo_id, result.commit, result.files, TOKEN).ok
    assert json.loads(Path(hf_hub_download(repo_id, STATE_FILE, token=TOKEN)).read_text()) == state


def test_a_repush_of_the_same_state_is_up_to_date(tmp_path: Path, repo_id: str) -> None:
    from huggingface_hub import hf_hub_download

    from publisher.stages.push import published_state, up_to_date

    folder, report, state = _folder(tmp_path)
    first = _push(folder, report, state, repo_id)
    before = _commits(repo_id)
    card = (folder / "README.md").read_text()
    (folder / "README.md").write_text(card + "\nRendered again.\n")  # the state says what counts, not the bytes
    again = _push(folder, report, state, repo_id)
    assert again.up_to_date and not again.created and again.commit == first.commit and not again.files
    assert _commits(repo_id) == before  # no new commit, nothing uploaded
    assert Path(hf_hub_download(repo_id, "README.md", token=TOKEN)).read_text() == card
    assert published_state(repo_id, TOKEN) == (first.commit, state)
    # the check a publish makes before it downloads anything: the same answer
    found, previous = up_to_date(repo_id, TOKEN, "fp-1", create_pr=False, force=False)
    assert found is not None and found.up_to_date and found.commit == first.commit and previous == state
    assert up_to_date(repo_id, TOKEN, "fp-2", create_pr=False, force=False) == (None, state)
    assert up_to_date(repo_id, TOKEN, "fp-1", create_pr=False, force=True) == (None, state)
    # --force over identical files: the Hub makes no empty commit
    (folder / "README.md").write_text(card)
    forced = _push(folder, report, state, repo_id, force=True)
    assert forced.up_to_date and forced.commit == first.commit and _commits(repo_id) == before


def test_a_republish_replaces_the_files_in_one_commit(tmp_path: Path, repo_id: str) -> None:
    from huggingface_hub import HfApi

    from publisher.stages.push import write_repo_files

    folder, report, state = _folder(tmp_path)
    first = _push(folder, report, state, repo_id)
    (folder / "tokenizer.json").unlink()  # no longer produced
    (folder / "README.md").write_text("# the new card\n")
    state = dict(state, fingerprint="fp-2")
    write_repo_files(folder, state)
    second = _push(folder, report, state, repo_id, message="Quantize again")
    assert not second.up_to_date and not second.created and second.commit != first.commit
    commits = _commits(repo_id)
    assert commits[0].commit_id == second.commit and commits[1].commit_id == first.commit
    files = set(HfApi(token=TOKEN).list_repo_files(repo_id))
    assert files == set(_local_files(folder)) and "tokenizer.json" not in files and ".gitattributes" in files


def test_a_report_that_did_not_pass_is_refused_before_any_repo_exists(tmp_path: Path, repo_id: str) -> None:
    from huggingface_hub import HfApi

    from publisher.errors import VerificationError

    folder, report, state = _folder(tmp_path)
    report.results[1] = uf.result("", "manual", "silently wrong", detail="loads without an error, but tensor x differs")
    report.passed = False
    with pytest.raises(VerificationError, match=rf"refusing to push {repo_id}: verification failed \(model via the manual "
                                                r"path \(current\): silently wrong: loads without an error"):
        _push(folder, report, state, repo_id)
    assert not HfApi(token=TOKEN).repo_exists(repo_id)
    # a folder another run produced (its state file's fingerprint is not this run's) is refused too
    folder, report, state = _folder(tmp_path / "other")
    with pytest.raises(VerificationError, match="was not produced by this run"):
        _push(folder, report, dict(state, fingerprint="fp-other"), repo_id)
    assert not HfApi(token=TOKEN).repo_exists(repo_id)


def test_create_pr_opens_a_pull_request_and_leaves_main_alone(tmp_path: Path, repo_id: str) -> None:
    from huggingface_hub import HfApi

    from publisher.stages.push import find_open_pr, published_state, write_repo_files

    folder, report, state = _folder(tmp_path)
    first = _push(folder, report, state, repo_id)
    (folder / "README.md").write_text("# proposed card\n")
    state = dict(state, fingerprint="fp-2")
    write_repo_files(folder, state)
    proposed = _push(folder, report, state, repo_id, create_pr=True, message="Quantize again")
    assert proposed.pr_url is not None and "/discussions/" in proposed.pr_url and not proposed.up_to_date
    api = HfApi(token=TOKEN)
    assert api.repo_info(repo_id).sha == first.commit  # main is unchanged
    num, ref = find_open_pr(repo_id, TOKEN)  # type: ignore[misc]
    assert proposed.pr_url.endswith(f"/discussions/{num}")
    (pr,) = [d for d in api.get_repo_discussions(repo_id, discussion_type="pull_request")]
    assert pr.title == "hf-ao-publish: Quantize again" and pr.status == "open"
    assert published_state(repo_id, TOKEN, ref) == (proposed.commit, state)
    # the same state again: our open pull request is up to date
    again = _push(folder, report, state, repo_id, create_pr=True)
    assert again.up_to_date and again.pr_url == proposed.pr_url and again.commit == proposed.commit
