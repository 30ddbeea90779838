"""action/result.py: the CLI's --json result -> the action's outputs."""

from __future__ import annotations

import json
from pathlib import Path

from action_harness import sample_result

from action.result import entries, outputs_for, parse


def test_outputs_for_several_recipes(tmp_path: Path) -> None:
    results = {"results": [sample_result(), sample_result(repo_id="alice/m-int8dq", recipe="int8dq", commit="b" * 40,
                                              url="http://hub/alice/m-int8dq", up_to_date=True)], "verified": True}
    out = outputs_for(results, None, 0, tmp_path / "gone")
    assert out["repo-id"] == "alice/m-int8wo\nalice/m-int8dq"
    assert out["commit-sha"] == "a" * 40 + "\n" + "b" * 40
    assert out["pr-url"] == "\n" and out["verified"] == "true" and out["up-to-date"] == "false" and out["output-dir"] == ""
    assert json.loads(out["result-json"]) == results
    failed = outputs_for(None, "boom", 1, None)
    assert failed["verified"] == "false" and json.loads(failed["result-json"]) == {"error": "boom", "exit_code": 1}


def test_one_recipe_and_a_failed_cli(tmp_path: Path) -> None:
    out = outputs_for(sample_result(up_to_date=True), None, 0, tmp_path)
    assert out["repo-id"] == "alice/m-int8wo" and out["up-to-date"] == "true" and out["output-dir"] == str(tmp_path)
    assert outputs_for(sample_result(), "Error", 1, None)["verified"] == "false"  # verified only when the CLI succeeded
    assert outputs_for(None, None, 3, None)["result-json"] == '{"error":"hf-ao-publish exited with code 3","exit_code":3}'


def test_parse_is_defensive() -> None:
    assert parse("") is None and parse("Traceback ...") is None
    assert entries(parse('{"results": [{"repo_id": "a/b"}, 3], "verified": false}')) == [{"repo_id": "a/b"}]
    assert entries({"error": "x"}) == [] and entries([1]) == []


def test_outputs_for_several_models(tmp_path: Path) -> None:
    """input models: the CLI prints a list, one object per job naming its model; each output has a line per job."""
    listed = [{"model": "org/a", "job_id": "j1", **sample_result(repo_id="alice/a-int8wo")},
              {"model": "org/b", "job_id": "j2", **sample_result(repo_id="alice/b-int8wo", commit="b" * 40)}]
    out = outputs_for(listed, None, 0, None)
    assert out["repo-id"] == "alice/a-int8wo\nalice/b-int8wo" and out["commit-sha"] == "a" * 40 + "\n" + "b" * 40
    assert out["verified"] == "true" and json.loads(out["result-json"]) == listed
    assert outputs_for(listed, "Error: 1 of 2 jobs failed", 1, None)["verified"] == "false"
    assert entries([listed[0], 3]) == [listed[0]]
