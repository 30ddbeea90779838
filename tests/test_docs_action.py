"""docs/action.md's workflows as a user pastes them: each ```yaml block lints with actionlint, and each runs, in the
page's order, in one loopback Hub session, through tests/workflow_harness.py (the action's own steps through
tests/action_harness.py), with the product's defaults: the quality evaluation and the compatibility matrix on.

Only three things differ from the page: the base model ids (meta-llama/Llama-3.2-1B is the loopback Hub's tiny Llama,
black-forest-labs/FLUX.1-* its tiny FLUX pipeline), the Hub (HF_ENDPOINT, the loopback) and the token (alice's). What
cannot run on this CPU is marked in the page (`# not run by the tests: REASON`) and only that is skipped.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from action_harness import ROOT, assert_secret_absent
from workflow_harness import DocWorkflow, WorkflowRun, assert_actionlint_clean, doc_workflows, run_workflow

yaml = pytest.importorskip("yaml")

PAGE = ROOT / "docs" / "action.md"
TOKEN = "tok_alice"


def test_every_workflow_in_the_page_lints(tmp_path: Path) -> None:
    docs = doc_workflows(PAGE)
    assert len(docs) >= 7, [d.name for d in docs]
    files = []
    for n, doc in enumerate(docs):
        workflow = yaml.safe_load(doc.text)
        assert {"name", "jobs", "permissions"} <= set(workflow) and (True in workflow or "on" in workflow), doc.name
        files.append(tmp_path / f"{n}-line{doc.line}.yml")
        files[-1].write_text(doc.text)
    assert_actionlint_clean(files)


def test_the_marks_name_a_reason_on_a_row_or_a_step() -> None:
    """A mark skips exactly one matrix row or step of the tests' runs; it says why the tests cannot run it."""
    marks = [(doc.name, line) for doc in doc_workflows(PAGE) for line in doc.text.splitlines() if "not run by the tests" in line]
    assert len(marks) == 3, marks  # the two GPU rows of the matrix, the HF Jobs step
    for name, line in marks:
        assert re.search(r"^\s*- .*# not run by the tests: \w.{8,}$", line), (name, line)


HARNESS_SELF_TEST = """
name: t
on:
  workflow_dispatch:
    inputs:
      word: {description: a word, default: cat}
      flag: {description: a flag, type: boolean, default: false}
permissions:
  contents: read
jobs:
  j:
    strategy:
      matrix:
        include:
          - {n: one}
          - {n: two}  # not run by the tests: the harness's own check of a marked row
    runs-on: ubuntu-latest
    timeout-minutes: 5
    steps:
      - uses: actions/checkout@v4
      - id: say
        run: echo "said=$WORD-$N-$FLAG-$TOKEN" >> "$GITHUB_OUTPUT"
        env: {WORD: '${{ inputs.word }}', N: '${{ matrix.n }}', FLAG: '${{ inputs.flag }}', TOKEN: '${{ secrets.HF_TOKEN }}'}
      - if: steps.say.outputs.said != 'cat-one-false-tok'
        run: exit 1
      - if: ${{ steps.say.outputs.said == 'cat-one-false-tok' }}
        run: test -f repo-file && echo ok >> "$GITHUB_STEP_SUMMARY"
      - run: echo never  # not run by the tests: the harness's own check of a marked step
"""


def test_the_workflow_harness(tmp_path: Path) -> None:
    """The runner of the page's workflows: inputs' defaults, matrix rows, secrets, outputs, `if:`, checkout, marks."""
    doc = DocWorkflow(1, HARNESS_SELF_TEST, False)
    run = run_workflow(doc, tmp_path, token="tok", checkout=lambda ws: (ws / "repo-file").write_text("x"))
    assert [(s.where.split(" (")[0], s.status) for s in run.steps] == [
        ("j[0] step 1", "ran"), ("j[0] step 2", "ran"), ("j[0] step 3", "if-false"), ("j[0] step 4", "ran"),
        ("j[0] step 5", "marked"), ("j[1]", "marked")]
    assert run.steps[1].outputs == {"said": "cat-one-false-tok"} and run.steps[3].summary == "ok\n"
    assert [reason for _, reason in run.marked()] == ["the harness's own check of a marked step",
                                                      "the harness's own check of a marked row"]
    with pytest.raises(AssertionError, match="does not evaluate"):
        run_workflow(DocWorkflow(1, HARNESS_SELF_TEST.replace("secrets.HF_TOKEN", "secrets.OTHER"), False), tmp_path / "b",
                     token="tok", checkout=lambda ws: None)
    with pytest.raises(AssertionError, match="is not a folder with files in it"):
        run_workflow(DocWorkflow(1, HARNESS_SELF_TEST.replace(
            "      - uses: actions/checkout@v4\n",
            "      - uses: actions/upload-artifact@v4\n        with: {name: x, path: nowhere}\n"), False), tmp_path / "c",
            token="tok", checkout=lambda ws: None)


@pytest.mark.slow
def test_every_workflow_in_the_page_runs(tmp_path: Path, hub: Any, llama_repo: str, flux_repo: str,
                                         tiny_flux_dir: Path, wikitext_repo: str) -> None:
    def substitute(text: str) -> str:
        text = text.replace("meta-llama/Llama-3.2-1B", llama_repo)
        return re.sub(r"black-forest-labs/FLUX\.1-[\w-]+", flux_repo, text)

    def checkout(workspace: Path) -> None:  # the repo of the dry-run example keeps its pipeline at ./my-pipeline
        shutil.copytree(tiny_flux_dir, workspace / "my-pipeline")

    docs = doc_workflows(PAGE)
    runs: list[tuple[DocWorkflow, WorkflowRun]] = []
    for n, doc in enumerate(docs):
        t0 = time.monotonic()
        runs.append((doc, run_workflow(doc, tmp_path / f"workflow-{n}", token=TOKEN, checkout=checkout,
                                       substitute=substitute)))
        print(f"{doc.name}: {time.monotonic() - t0:.0f} s")  # what each example costs here (shown with -s or -rP)
    for doc, run in runs:
        for step in run.steps:
            assert step.status in ("ran", "checked", "marked"), (doc.name, step.where, step.status)
            assert step.returncode == 0, (doc.name, step.where, step.log[-4000:])
            if step.action is not None:
                assert not step.action.errors(), (doc.name, step.where, step.action.errors())
                assert step.outputs["verified"] == "true", (doc.name, step.where)
                if step.inputs.get("hf-token"):
                    assert_secret_absent(step.action, TOKEN)
    assert [(doc.line, where, reason) for doc, run in runs for where, reason in run.marked()] == [
        (_line_of("- {recipe: float8dq"), "publish[3]", "needs a self-hosted CUDA runner"),
        (_line_of("- {recipe: float8dq"), "publish[4]", "needs a self-hosted CUDA runner"),
        (_line_of("`int4wo` and FP8 with GPU figures"), "snippet step 1 (hf-ao-publish/hf-ao-publish@v0.1.0)",
         "int4wo needs a CUDA GPU in the job"),
    ]
    _check_what_each_published(runs)


def _line_of(text: str) -> int:
    """The first YAML line of the block that follows (or holds) the first line of the page containing ``text``."""
    lines = PAGE.read_text().splitlines()
    at = next(n for n, line in enumerate(lines) if text in line)
    starts = [doc.line for doc in doc_workflows(PAGE)]
    return max(s for s in starts if s <= at + 1) if text.startswith("- ") else min(s for s in starts if s > at)


def _ran_the_defaults(data: dict[str, Any]) -> None:
    """A publish made as a runner makes it: the compatibility matrix measured, the evaluation run within its budget."""
    assert data["verification"]["compat"] and data["verification"]["environments"], data["verification"]
    figures = data["evaluation"]
    if figures["kind"] == "pipeline":  # the default budget, auto: about 5 s for the tiny FLUX's 5 MB
        assert figures["budget_s"] == pytest.approx(5.3, abs=0.5), figures
        assert figures["seconds"] <= figures["budget_s"] + 5 and (figures["psnr"] or figures["reason"]), figures
    else:  # a language model's perplexity, on the default dataset (the loopback Hub's copy)
        assert figures["base_ppl"] and figures["quantized_ppl"], figures


def _check_what_each_published(runs: list[tuple[DocWorkflow, WorkflowRun]]) -> None:
    """Each example's publishes, in the page's order: the first of a target makes a commit; an example that publishes
    exactly what an earlier one did finds its target up to date, before any download."""
    from huggingface_hub import HfApi

    api = HfApi(token=TOKEN)
    actions = [(doc, step) for doc, run in runs for step in run.actions()]
    first: dict[str, str] = {}
    for doc, step in actions:
        out = step.outputs
        data = json.loads(out["result-json"])
        if step.inputs.get("recheck"):  # measured again (the page's earlier example published it): a PR or nothing
            (repo,) = data["repos"]
            assert repo["repo"] == "my-org/Llama-3.2-1B-torchao-int8wo" and not repo.get("error") and repo["loads"] > 2, repo
            assert out["pr-url"] == (repo["pull_request"] or "") and (out["up-to-date"] == "true") == (not repo["changes"])
            assert api.model_info(repo["repo"]).sha == repo["revision"]  # a pull request at most: main untouched
            continue
        if step.inputs.get("push") == "false":
            assert out["commit-sha"] == "" and not data["pushed"], (doc.name, out)
            assert data["verification"]["compat"] and data["evaluation"] is None  # the example's --eval-budget 0
            continue
        repo = out["repo-id"]
        assert repo and re.fullmatch(r"[0-9a-f]{40}", out["commit-sha"]), (doc.name, out)
        if repo in first:
            assert out["up-to-date"] == "true" and out["commit-sha"] == first[repo], (doc.name, step.where, out)
            assert step.action is not None and "is up to date" in step.action.stderr
            assert "downloading" not in step.action.stderr  # checked before any download
        else:
            assert out["up-to-date"] == "false", (doc.name, step.where, out)
            _ran_the_defaults(data)
            first[repo] = out["commit-sha"]
        assert api.list_repo_commits(repo)[0].commit_id == out["commit-sha"]
    assert set(first) == {"alice/tiny-llama-torchao-int8wo", "alice/tiny-flux-torchao-int8wo",
                          "alice/tiny-llama-torchao-int8dq", "alice/tiny-llama-torchao-float8wo",
                          "my-org/Llama-3.2-1B-torchao-int8wo"}, first
    ups = [(doc.line, step.where) for doc, step in actions if step.outputs["up-to-date"] == "true" and not step.inputs.get("recheck")]
    # the caching example and the recipes' matrix's int8wo row publish what the first example did; the models' matrix
    # what the first example and the manual dispatch did
    assert len(ups) == 4, ups

    by_line = {doc.line: run for doc, run in runs}
    top = by_line[min(by_line)]  # the page's first example: publish, then print where
    assert [s.status for s in top.steps] == ["ran", "ran"]
    assert f"published {top.steps[0].outputs['repo-url']} at {top.steps[0].outputs['commit-sha']}" in top.steps[1].log
    schedule = by_line[_line_of("Republish on a schedule")]
    assert [s.status for s in schedule.steps] == ["ran", "ran"]  # published, so the `if:` step ran
    assert f"republished {schedule.steps[0].outputs['repo-url']} at" in schedule.steps[1].summary
    weekly = by_line[_line_of("Rechecking published repos every week")]
    assert [s.status for s in weekly.steps] == ["ran", "ran"] and "rechecked; unchanged: " in weekly.steps[1].summary
    dry = by_line[_line_of("Dry run on pull requests")]
    assert [s.status for s in dry.steps] == ["ran", "ran", "checked"]  # checkout, the action, the upload
    folder = Path(dry.steps[1].outputs["output-dir"])  # what the upload's path names
    assert (folder / "README.md").is_file() and (folder / "verification.json").is_file()
    assert "not pushed" in dry.steps[1].log
    assert "--eval-budget 0" in (folder / "README.md").read_text()  # the example's extra-args reached the CLI
