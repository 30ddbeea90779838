"""`hf-ao-publish recheck REPO...` against the loopback Hub (issue 39): a published repo measured again; a pull request
when a row is new or changed, updated rather than doubled while it is open, nothing when nothing changed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import HfApi, hf_hub_download

from publisher.stages import recheck

FAILING = "torchao==0.17.0"  # cannot build torchao 0.18's tensors (tests/test_verify_matrix.py): a row that fails


def _files(repo: str, revision: str, tmp: Path) -> tuple[str, dict[str, Any]]:
    card = Path(hf_hub_download(repo, "README.md", revision=revision, cache_dir=tmp)).read_text()
    record = json.loads(Path(hf_hub_download(repo, "verification.json", revision=revision, cache_dir=tmp)).read_text())
    return card, record


@pytest.mark.slow
def test_recheck_proposes_changed_rows_once_and_nothing_when_nothing_changed(cli: Any, llama_repo: str, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    repo = "alice/recheck-llama-int8wo"
    api = HfApi(token="tok_alice")
    made = cli(llama_repo, "--quant", "int8wo", "--repo-id", repo, "--compat", "none", "--eval-budget", "0", token="tok_alice")
    assert made.exit_code == 0, made.output
    main = api.model_info(repo).sha
    published_card, _ = _files(repo, "main", tmp_path / "a")

    same = cli("recheck", repo, "--compat", "none", "--json", token="tok_alice")  # the same environment, nothing more
    assert same.exit_code == 0, same.output
    (result,) = json.loads(same.stdout)["repos"]
    assert result["changes"] == [] and result["pull_request"] is None and result["loads"] == 2
    assert api.model_info(repo).sha == main and not list(api.get_repo_discussions(repo))
    assert f"{repo}: nothing changed (2 loads measured); nothing written" in same.stderr

    changed = cli("recheck", repo, "--compat", FAILING, "--json", token="tok_alice")
    assert changed.exit_code == 0, changed.output
    (result,) = json.loads(changed.stdout)["repos"]
    assert [(c["path"], c["before"], c["after"]) for c in result["changes"]] == [("library", None, "fail"), ("manual", None, "fail")]
    assert "torchao 0.17.0" in result["changes"][0]["versions"] and result["pull_request"].endswith("/discussions/1")
    assert api.model_info(repo).sha == main  # a pull request, main untouched
    card, record = _files(repo, "refs/pr/1", tmp_path / "b")
    rows = [line for line in card.splitlines() if line.startswith(f"| this one with `{FAILING}`")]
    assert len(rows) == 1 and rows[0].count("| fail: ") == 2, rows
    assert "| this tool's own (made and verified here) | model |" in card  # the publish's own row stays first
    assert "torchao >= 0.18.0 (measured: 0.18.0 pass; 0.17.0 fail" in card  # the claims follow the rows
    before, after = published_card.split("## Software requirements")[0], card.split("## Software requirements")[0]
    assert before == after and published_card.split("## How to use")[1] == card.split("## How to use")[1]  # the rest as published
    assert [r["env"] for r in record["compat"]] == [FAILING, FAILING]
    assert record["rechecks"][0]["revision"] == main and len(record["rechecks"][0]["changes"]) == 2

    again = cli("recheck", repo, "--compat", FAILING, token="tok_alice")  # the PR is still open: updated, not doubled
    assert again.exit_code == 0, again.output
    assert again.stdout.strip().endswith("/discussions/1")
    assert [d.num for d in api.get_repo_discussions(repo)] == [1]

    api.merge_pull_request(repo, 1)
    merged = cli("recheck", repo, "--compat", FAILING, "--json", token="tok_alice")
    (result,) = json.loads(merged.stdout)["repos"]
    assert result["changes"] == [] and result["pull_request"] is None  # what the card says is what was measured


def test_a_repo_that_cannot_be_rechecked_does_not_stop_the_others(cli: Any, hub: Any) -> None:
    result = cli("recheck", "alice/does-not-exist", "bob/neither", "--compat", "none", "--json", token="tok_alice")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [r["repo"] for r in data["repos"]] == ["alice/does-not-exist", "bob/neither"]
    assert all("not found" in r["error"] for r in data["repos"]) and data["error"] == "2 of 2 repos could not be rechecked"


def test_a_card_without_those_sections_gets_them_at_its_end() -> None:
    assert recheck.replace_section("# A card\n\nText.\n", "## Compatibility\n\nrows\n") == (
        "# A card\n\nText.\n\n## Compatibility\n\nrows\n")
    card = "# T\n\n## Software requirements\n\nold\n\n## Compatibility\n\nold rows\n\n## How to use\n\nsnippet\n"
    assert recheck.replace_section(card, "## Software requirements\n\nnew\n\n## Compatibility\n\nnew rows\n") == (
        "# T\n\n## Software requirements\n\nnew\n\n## Compatibility\n\nnew rows\n\n## How to use\n\nsnippet\n")
