"""--json: stdout holds exactly one JSON document for every command and every way it ends, errors included.

The job and the verification are replaced by stand-ins where a path needs one; the cheap checks of the real job
(an unknown recipe, a missing token, a bad option value) run for real, without a Hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from publisher.cli import main
from publisher.errors import RunFailed, SourceError
from publisher.handoffs.report import PathResult, VerifyReport
from publisher.request import Outcome, PublishRequest


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def one_document(result: Result) -> Any:
    """stdout parsed as one JSON document (json.loads refuses two documents, or anything around one)."""
    return json.loads(result.stdout)


def error_object(result: Result) -> dict[str, Any]:
    data = one_document(result)
    assert data["exit_code"] == result.exit_code != 0
    line = result.stderr.strip().splitlines()[-1]
    assert line == f"Error: {data['error']}", (line, data)  # the same words on stderr, as without --json
    return data


@pytest.mark.parametrize(("args", "code", "words"), [
    (["some/model", "--json"], 2, "Missing option '--quant'"),  # click, while parsing the command
    (["--json", "--no-such-option"], 2, "No such option '--no-such-option'"),  # click, at the group
    (["some/model", "--quant", "int3", "--json"], 2, "unknown recipe 'int3'"),  # our usage error, from the job's checks
    (["some/model", "--quant", "int8wo", "--max-shard-size", "huge", "--json"], 2, "is not a size"),
    (["some/model", "--quant", "int8wo", "--json"], 1, "pushing needs a Hub token"),  # a failure of the real job
    (["publish", "--attach", "j1", "--quant", "int8wo", "--json"], 2, "give it without MODEL_ID"),
    (["verify", "--json"], 2, "Missing argument 'TARGET'"),
    (["verify", "alice/x", "--compat", "diffusers", "--json"], 2, "is not an environment"),
    (["recipes", "--json", "--wide"], 2, "No such option '--wide'"),
])
def test_every_error_is_one_json_object(args: list[str], code: int, words: str) -> None:
    result = invoke(*args)
    assert result.exit_code == code, result.output
    assert words in error_object(result)["error"]


def test_without_json_stdout_stays_empty_on_an_error() -> None:
    result = invoke("some/model", "--quant", "int8wo")
    assert result.exit_code == 1 and result.stdout == ""


def test_a_library_error_and_a_bug_are_objects_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from publisher import job

    def source_error(req: PublishRequest) -> list[Outcome]:
        raise SourceError("some/model is neither a diffusers pipeline nor a transformers model")

    monkeypatch.setattr(job, "run", source_error)
    assert "is neither a diffusers pipeline" in error_object(invoke("some/model", "--quant", "int8wo", "--json"))["error"]
    with pytest.raises(SourceError):  # --debug: the traceback, and the same object on stdout before it
        CliRunner().invoke(main, ["some/model", "--quant", "int8wo", "--json", "--debug"], catch_exceptions=False)

    def bug(req: PublishRequest) -> list[Outcome]:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(job, "run", bug)
    runner = CliRunner()
    result = runner.invoke(main, ["some/model", "--quant", "int8wo", "--json"])  # the traceback is click's to show
    assert isinstance(result.exception, ZeroDivisionError)
    assert one_document(result) == {"error": "internal error: ZeroDivisionError: division by zero", "exit_code": 1}


def test_a_failed_run_prints_its_results_with_the_error_in_one_object(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from publisher import job

    def keep_going(req: PublishRequest) -> list[Outcome]:
        return [Outcome("int8wo", "alice/m-int8wo", folder=tmp_path, verified=True),
                Outcome("float8wo", "alice/m-float8wo", error="float8wo: injected")]

    monkeypatch.setattr(job, "run", keep_going)
    result = invoke("some/model", "--quant", "int8wo,float8wo", "--keep-going", "--json")
    assert result.exit_code == 1
    data = one_document(result)
    assert data["error"] == "1 of 2 recipes failed" and data["exit_code"] == 1
    assert [r["error"] for r in data["results"]] == [None, "float8wo: injected"]

    def stopped(req: PublishRequest) -> list[Outcome]:
        outcome = Outcome("int8wo", "alice/m-int8wo")
        raise RunFailed(SourceError("the base changed while it was read; re-run"), [outcome])

    monkeypatch.setattr(job, "run", stopped)
    result = invoke("some/model", "--quant", "int8wo", "--json")
    data = one_document(result)  # the one recipe's result, carrying the run's error
    assert result.exit_code == 1 and data["recipe"] == "int8wo" and data["exit_code"] == 1
    assert data["error"] == "the base changed while it was read; re-run"


def test_a_failed_verification_is_its_report_with_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import publisher.verify.target as target_module

    def verify_target(target: str, work: Path, **kwargs: Any) -> VerifyReport:
        result = PathResult("transformer", "library", "current", {}, ok=False, detail="tensor w differs")
        return VerifyReport(recipe="int8wo", location=target, passed=False, results=[result])

    monkeypatch.setattr(target_module, "verify_target", verify_target)
    result = invoke("verify", "alice/x", "--json", "--compat", "none")
    assert result.exit_code == 1
    data = error_object(result)
    assert data["passed"] is False and data["results"][0]["detail"] == "tensor w differs"
    assert data["error"].startswith("verification of alice/x failed")
