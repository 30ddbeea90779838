"""The command line: one test per advertised option of every command (a meta-test keeps it so),
the recipes listing, the shared options and the library-noise filter.

Options that need a publish or a verification replace the job with a recorder (``job.run`` /
``verify_target``) and assert what reached it; the cheap checks of the real job (unknown recipe,
bad target id, output folder, missing token) run for real. The end-to-end noise checks run the real
command on a tiny model and are marked slow.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner, Result
from helpers import IN_PROCESS, PROGRESS_VARS, SKIP_EVAL_AND_MATRIX, progress_bars

from publisher import __version__
from publisher import recipes as recipe_registry
from publisher.cli import main
from publisher.cli.recipe_table import RECIPES_WIDTH
from publisher.errors import SourceError, TargetError
from publisher.handoffs.report import PathResult, VerifyReport
from publisher.request import Outcome, PublishRequest
from publisher.runtime import logs

SMALL = ["--sample-steps", "2", "--sample-size", "64"]
SECRET = "hf_s3cret_never_printed"


def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False, env=env)


# ---------------------------------------------------------------- every advertised option has a test

def _option_tests() -> list[str]:
    """test_<command>_<longest option name> for every parameter of every command, the group's included."""
    root = click.Context(main, info_name="hf-ao-publish", **main.context_settings)  # with -h, as when run
    commands = {"main": main, **main.commands}
    wanted = []
    for cmd_name, cmd in commands.items():
        ctx = root if cmd is main else click.Context(cmd, parent=root, info_name=cmd_name)
        for param in cmd.get_params(ctx):
            name = max(param.opts, key=len).lstrip("-").replace("-", "_") if isinstance(param, click.Option) else param.name
            wanted.append(f"test_{cmd_name}_{name}")
    return wanted


def test_every_advertised_option_has_a_test() -> None:
    missing = [name for name in _option_tests() if not callable(globals().get(name))]
    assert not missing, f"options without a CLI test: {missing}"


# ---------------------------------------------------------------- the group

def test_main_help() -> None:
    for flag in ("--help", "-h"):
        result = invoke(flag)
        assert result.exit_code == 0
        # both forms: publish needs no command name, as the example shows
        assert result.stdout.startswith("Usage: hf-ao-publish [OPTIONS] COMMAND [ARGS]...\n"
                                        "       hf-ao-publish [publish] MODEL_ID --quant RECIPE [OPTIONS]\n")
        assert "hf-ao-publish black-forest-labs/FLUX.1-dev --quant int8wo\n" in result.stdout
        assert "hf-ao-publish publish black-forest-labs/FLUX.1-dev --quant int8wo\n" in result.stdout
        assert re.findall(r"^  (\w+)  ", result.stdout, re.MULTILINE) == ["publish", "recheck", "recipes", "verify"]
        assert "--list-recipes" not in result.stdout


def test_main_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"hf-ao-publish, version {__version__}\n"


def test_no_arguments_is_a_usage_error_that_shows_help() -> None:
    result = invoke()
    assert result.exit_code == 2
    assert "Usage: hf-ao-publish [OPTIONS] COMMAND [ARGS]..." in result.output


def test_list_recipes_is_not_an_option() -> None:
    # It used to be advertised and exit 2 with "Missing command."; `recipes` is the one way to list them.
    result = invoke("--list-recipes")
    assert result.exit_code == 2
    assert "No such option '--list-recipes'" in result.stderr


def test_a_model_id_defaults_to_publish() -> None:
    result = invoke("some/model")
    assert result.exit_code == 2
    assert "Usage: hf-ao-publish publish [OPTIONS] MODEL_ID" in result.stderr
    assert "Missing option '--quant'" in result.stderr


@pytest.mark.parametrize(("typed", "command"), [("verfy", "verify"), ("recipe", "recipes"), ("Verify", "verify"),
                                               ("publsh", "publish")])
def test_a_mistyped_command_names_the_command(typed: str, command: str) -> None:
    result = invoke(typed, "./out")  # not "Got unexpected extra argument", nor "Missing option '--quant'" (publish's)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"Error: No such command '{typed}'. Did you mean '{command}'?"
    assert invoke(typed).stderr.splitlines()[-1] == f"Error: No such command '{typed}'. Did you mean '{command}'?"


def test_a_word_like_a_command_that_can_be_a_model_id_still_publishes(
        cli: Any, hub: Any, tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    shutil.copytree(tiny_llama_dir, tmp_path / "verfy")
    monkeypatch.chdir(tmp_path)
    result = cli("verfy", "--quant", "int8wo", "--no-push", "--output-dir", "out", *SKIP_EVAL_AND_MATRIX, *IN_PROCESS)
    assert result.exit_code == 0, result.output
    assert result.stdout == "out\n" and (tmp_path / "out" / "README.md").is_file()
    result = cli("alice/verfy", "--quant", "int8wo", "--no-push", *SKIP_EVAL_AND_MATRIX)  # a repo id: read from the Hub
    assert result.exit_code == 1
    assert "repo alice/verfy not found" in result.stderr


def test_help_imports_no_heavy_library() -> None:
    code = ("import sys\nfrom publisher.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print([m for m in ('torch', 'torchao', 'diffusers', 'transformers', 'huggingface_hub') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---------------------------------------------------------------- recipes

def test_recipes_help() -> None:
    result = invoke("recipes", "--help")
    assert result.exit_code == 0
    assert "List the quantization recipes and the hardware each needs." in result.stdout
    assert "--json" in result.stdout


def _blocks(text: str) -> dict[str, str]:
    """recipe name -> its block of `hf-ao-publish recipes` text."""
    return {block.split()[0]: block for block in text.split("\n\n")[1:]}


def test_recipes_lists_the_registry_within_100_columns() -> None:
    result = invoke("recipes")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= RECIPES_WIDTH
    blocks = _blocks(result.stdout)
    assert list(blocks) == recipe_registry.names()
    for recipe in recipe_registry.all_recipes():
        flat = " ".join(blocks[recipe.name].split())  # undo the wrapping
        for text in (recipe.summary, recipe.quantize_on, recipe.run.describe(), recipe.speedup, recipe.expression, *recipe.notes):
            assert " ".join(text.split()) in flat, (recipe.name, text)


def test_recipes_say_fp8_dynamic_is_made_on_a_cpu_and_runs_on_cc_89() -> None:
    blocks = _blocks(invoke("recipes").stdout)
    for name in ("float8dq", "float8dq-tensor"):
        assert recipe_registry.get(name).cpu_producible
        flat = " ".join(blocks[name].split())
        assert "quantize on CPU or any GPU" in flat
        assert "run on CUDA GPU with compute capability >= 8.9" in flat
    assert "quantize on CUDA GPU with compute capability >= 8.0" in " ".join(blocks["int4wo"].split())


def test_recipes_wraps_long_registry_text(monkeypatch: pytest.MonkeyPatch) -> None:
    base = recipe_registry.get("int4wo")
    long = dataclasses.replace(base, name="x" * 120, summary="word " * 60, notes=("n" * 150, "short note"))
    monkeypatch.setattr(recipe_registry, "all_recipes", lambda: [base, long])
    result = invoke("recipes")
    assert result.exit_code == 0
    assert max(len(line) for line in result.stdout.splitlines()) <= RECIPES_WIDTH
    assert "short note" in result.stdout


def test_recipes_json() -> None:
    result = invoke("recipes", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data == [r.to_dict() for r in recipe_registry.all_recipes()]
    by_name = {d["name"]: d for d in data}
    assert by_name["float8dq"]["quantize_on"]["cpu"] is True
    assert by_name["float8dq"]["quantize_on"]["gpu_min_cc"] == "8.9"
    assert by_name["float8dq"]["run_on"] == {"cpu": False, "gpu_min_cc": "8.9", "packages": [],
                                             "text": "CUDA GPU with compute capability >= 8.9"}
    assert by_name["int4wo"]["quantize_on"]["cpu"] is False
    assert by_name["int8wo"]["quantize_on"]["cpu"] is True and by_name["int8wo"]["run_on"]["cpu"] is True


# ---------------------------------------------------------------- verify (verify_target replaced by a recorder)

@pytest.fixture
def fake_verify(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the verification with a recorder; set calls["passed"] / calls["raise"] to change its answer."""
    import publisher.verify.target as target_module

    calls: dict[str, Any] = {"passed": True}

    def verify_target(target: str, work: Path, **kwargs: Any) -> VerifyReport:
        calls.update(target=target, work=work, **kwargs)
        logging.getLogger("publisher.verify.target").info("info from the verification")
        logging.getLogger("publisher.verify.target").warning("warning from the verification")
        if "raise" in calls:
            raise calls["raise"]
        result = PathResult("transformer", "library", "current", {"torch": "2.x", "torchao": "0.18.0"},
                            ok=calls["passed"], detail="" if calls["passed"] else "tensor w differs", quantized_layers=3)
        return VerifyReport(recipe="int8wo", location=target, passed=calls["passed"], results=[result])

    monkeypatch.setattr(target_module, "verify_target", verify_target)
    return calls


def test_verify_help() -> None:
    result = invoke("verify", "--help")
    assert result.exit_code == 0
    assert result.stdout.startswith("Usage: hf-ao-publish verify [OPTIONS] TARGET")
    for option in ("--revision", "--token", "--verify-env", "--compat", "--no-requantize", "--json", "--debug", "--quiet"):
        assert option in result.stdout


def test_verify_says_what_the_default_matrix_costs_and_how_to_skip_it(fake_verify: dict[str, Any]) -> None:
    from publisher import compat

    help_text = " ".join(invoke("verify", "--help").stdout.split())
    assert "unless --compat none, it measures the compatibility matrix, which costs more than the check itself" in help_text
    most = len([e for e in compat.DEFAULT_MATRIX if e.spec != "torchao==0.18.0"])  # that one is this environment
    assert f"the default matrix has up to {most} environments" in help_text and "minutes even for a tiny model" in help_text
    first = invoke("verify", "alice/x").stderr.splitlines()[0]
    assert first.startswith(f"verifying alice/x: every load path in this environment; then the default compatibility "
                            f"matrix: up to {most} environments")
    assert first.endswith("minutes even for a tiny model (--compat none skips it)")
    skipped = invoke("verify", "alice/x", "--compat", "none", "--verify-env", "/venv-a/bin/python").stderr.splitlines()[0]
    assert skipped == ("verifying alice/x: every load path in this environment and in 1 --verify-env environment(s), "
                       "which must pass; then no compatibility matrix (--compat none)")


def test_verify_target(fake_verify: dict[str, Any]) -> None:
    result = invoke("verify", "alice/tiny-int8wo")
    assert result.exit_code == 0, result.output
    assert fake_verify["target"] == "alice/tiny-int8wo"
    assert fake_verify["revision"] is None and fake_verify["token"] is None and fake_verify["envs"] == ()
    assert result.stdout.splitlines()[0].split() == ["component", "path", "environment", "result", "layers", "detail"]
    assert result.stdout.splitlines()[1].split()[:2] == ["transformer", "library"]
    assert "alice/tiny-int8wo: all 1 load checks passed" in result.stderr


def test_verify_failure_exits_1(fake_verify: dict[str, Any]) -> None:
    fake_verify["passed"] = False
    result = invoke("verify", "alice/tiny-int8wo")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (
        "Error: verification of alice/tiny-int8wo failed: transformer via the library path (current): tensor w differs")


def test_verify_missing_target_is_a_usage_error() -> None:
    result = invoke("verify")
    assert result.exit_code == 2 and "Missing argument 'TARGET'" in result.stderr


def test_verify_revision(fake_verify: dict[str, Any]) -> None:
    assert invoke("verify", "alice/x", "--revision", "v1.0").exit_code == 0
    assert fake_verify["revision"] == "v1.0"


def test_verify_token(fake_verify: dict[str, Any]) -> None:
    result = invoke("verify", "alice/x", "--token", SECRET)
    assert result.exit_code == 0 and fake_verify["token"] == SECRET
    assert SECRET not in result.output
    result = invoke("verify", "alice/x", env={"HF_TOKEN": SECRET})
    assert result.exit_code == 0 and fake_verify["token"] == SECRET
    assert SECRET not in result.output


def test_verify_verify_env(fake_verify: dict[str, Any]) -> None:
    assert invoke("verify", "alice/x", "--verify-env", "/venv-a/bin/python", "--verify-env", "/venv-b/bin/python").exit_code == 0
    assert fake_verify["envs"] == ("/venv-a/bin/python", "/venv-b/bin/python")


def test_verify_verify_env_takes_specs(fake_verify: dict[str, Any]) -> None:
    spec = "transformers==4.57.6,diffusers==0.39.0"
    assert invoke("verify", "alice/x", "--verify-env", spec, "--verify-env", "torchao==0.17.*").exit_code == 0
    assert fake_verify["envs"] == (spec, "torchao==0.17.*")
    assert "PYTHON|SPEC" in invoke("verify", "--help").stdout


def test_verify_compat(fake_verify: dict[str, Any]) -> None:
    assert invoke("verify", "alice/x").exit_code == 0
    assert fake_verify["compat"] == ()  # the default matrix
    assert invoke("verify", "alice/x", env={"HF_AO_PUBLISH_COMPAT": "none"}).exit_code == 0
    assert fake_verify["compat"] == ("none",)  # the variable's value
    assert invoke("verify", "alice/x", "--compat", "default", "--compat", "diffusers==0.39.0").exit_code == 0
    assert fake_verify["compat"] == ("default", "diffusers==0.39.0")
    assert "HF_AO_PUBLISH_COMPAT" in invoke("verify", "--help").stdout


def test_verify_prints_three_outcomes_and_measured_failures_do_not_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    import publisher.verify.target as target_module
    from publisher.handoffs.report import EnvRecord

    def verify_target(target: str, work: Path, **kwargs: Any) -> VerifyReport:
        versions = {"torch": "2.13.0", "torchao": "0.18.0", "diffusers": "0.42.1", "safetensors": "0.8.0"}
        current = [PathResult("transformer", p, "current", versions, True, quantized_layers=30) for p in ("library", "manual")]
        silent = PathResult("transformer", "library", "diffusers==0.38.0", {**versions, "diffusers": "0.38.0"}, False,
                            detail="loads without an error, but 0 of 30 planned layers are Int8Tensor", silent=True)
        failed = PathResult("transformer", "manual", "torchao==0.17.0", {**versions, "torchao": "0.17.0"}, False,
                            detail="ValueError: reduce_range")
        envs = [EnvRecord("current", "current", True), EnvRecord("diffusers==0.38.0", "spec", False),
                EnvRecord("torchao==0.17.0", "spec", False)]
        return VerifyReport("int8wo", target, True, results=current, compat=[silent, failed], environments=envs)

    monkeypatch.setattr(target_module, "verify_target", verify_target)
    result = invoke("verify", "alice/x")
    assert result.exit_code == 0, result.output  # the matrix is measured; only this environment and --verify-env decide
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["component", "path", "environment", "result", "layers", "detail"]
    assert lines[1].split()[:4] == ["transformer", "library", "current", "pass"]
    assert "diffusers==0.38.0 (measured)" in lines[3] and "SILENTLY WRONG" in lines[3] and "0 of 30" in lines[3]
    assert "torchao==0.17.0 (measured)" in lines[4] and " FAIL " in lines[4] and "reduce_range" in lines[4]
    assert "alice/x: all 2 load checks passed; other environments: 1 fail, 1 silently wrong" in result.stderr
    data = json.loads(invoke("verify", "alice/x", "--json").stdout)
    assert [r["outcome"] for r in data["compat"]] == ["silently wrong", "fail"]
    assert [r["outcome"] for r in data["results"]] == ["pass", "pass"]


def test_verify_compat_and_verify_env_values_are_checked_before_any_work() -> None:
    for args, message in ((["--compat", "none", "--compat", "default"], "--compat none cannot be combined"),
                          (["--compat", "diffusers"], "--compat 'diffusers' is not an environment"),
                          (["--compat", "diffusers==0.39.0,diffusers==0.40.0"], "diffusers is named twice"),
                          (["--verify-env", "/no/such/python"], "is neither a Python interpreter")):
        result = invoke("verify", "alice/does-not-exist", *args)  # no Hub request: the repo would not be found
        assert result.exit_code == 2, result.output
        assert message in result.stderr and "not found" not in result.stderr
    result = invoke("verify", "alice/does-not-exist", "--verify-env", "sh")  # a command on PATH is an interpreter too
    assert result.exit_code == 1 and "is neither a Python interpreter" not in result.stderr


def test_verify_base(fake_verify: dict[str, Any]) -> None:
    assert invoke("verify", "alice/x").exit_code == 0
    assert fake_verify["base"] is None  # the base the target names, when reachable
    result = invoke("verify", "alice/x", "--base", "meta/tiny-llama")
    assert result.exit_code == 0 and fake_verify["base"] == "meta/tiny-llama"
    assert "--base BASE" in invoke("verify", "--help").stdout


def test_verify_says_when_values_were_only_checked_for_self_consistency(monkeypatch: pytest.MonkeyPatch) -> None:
    import publisher.verify.target as target_module
    from publisher.handoffs.report import ContentCheck

    def verify_target(target: str, work: Path, **kwargs: Any) -> VerifyReport:
        result = PathResult("", "library", "current", {"torch": "2.x"}, ok=True, quantized_layers=3)
        return VerifyReport("unknown", target, True, results=[result], self_consistency_only=True,
                            values="only checked for self-consistency (no base named)",
                            content=[ContentCheck("", "declared config", True, "3 quantized layers stored as declared")])

    monkeypatch.setattr(target_module, "verify_target", verify_target)
    result = invoke("verify", "alice/x")
    assert result.exit_code == 0
    assert "declared config   pass   3 quantized layers stored as declared" in result.stdout
    assert "Values: only checked for self-consistency (no base named)." in result.stdout
    assert "alice/x: all 1 load checks passed; values only checked for self-consistency (no base compared)" in result.stderr
    data = json.loads(invoke("verify", "alice/x", "--json").stdout)
    assert data["self_consistency_only"] is True and data["content"][0]["what"] == "declared config"


def test_verify_no_requantize(fake_verify: dict[str, Any]) -> None:
    assert invoke("verify", "alice/x").exit_code == 0
    assert fake_verify["requantize"] is True
    assert invoke("verify", "alice/x", "--no-requantize").exit_code == 0
    assert fake_verify["requantize"] is False


# ---------------------------------------------------------------- recheck (the stage replaced by a recorder)

@pytest.fixture
def fake_recheck(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Replace the recheck with a recorder; calls["fail"] names repos that cannot be rechecked, calls["changed"] those
    whose rows changed."""
    import publisher.stages.recheck as recheck_module
    from publisher.errors import SourceError
    from publisher.stages.recheck import Change, RecheckResult

    calls: dict[str, Any] = {"repos": [], "fail": set(), "changed": set()}

    def recheck(repo: str, work: Path, **kwargs: Any) -> RecheckResult:
        calls["repos"].append(repo)
        calls.update(kwargs)
        logging.getLogger("publisher.stages.recheck").info("info from the recheck")
        logging.getLogger("publisher.stages.recheck").warning("warning from the recheck")
        if repo in calls["fail"]:
            raise SourceError(f"repo {repo} not found")
        if repo in calls["changed"]:
            return RecheckResult(repo, "a" * 40, 4, [Change("model", "library", "torch 2.15.0", None, "fail")],
                                 f"https://hub/{repo}/discussions/1")
        return RecheckResult(repo, "a" * 40, 4)

    monkeypatch.setattr(recheck_module, "recheck", recheck)
    return calls


def test_recheck_help() -> None:
    result = invoke("recheck", "--help")
    assert result.exit_code == 0 and result.stdout.startswith("Usage: hf-ao-publish recheck [OPTIONS] REPO...")
    for option in ("--token", "--compat", "--json", "--debug", "--quiet"):
        assert option in result.stdout


def test_recheck_repos(fake_recheck: dict[str, Any]) -> None:
    fake_recheck["changed"].add("alice/b")
    result = invoke("recheck", "alice/a", "alice/b")
    assert result.exit_code == 0 and fake_recheck["repos"] == ["alice/a", "alice/b"]
    assert result.stdout.splitlines() == ["alice/a\tnothing changed\t-", "alice/b\t1 row(s) changed\thttps://hub/alice/b/discussions/1"]
    assert "alice/b: 1 row(s) changed (4 loads measured); pull request: https://hub/alice/b/discussions/1" in result.stderr
    missing = invoke("recheck")
    assert missing.exit_code == 2 and "Missing argument 'REPO...'" in missing.stderr


def test_recheck_token(fake_recheck: dict[str, Any]) -> None:
    result = invoke("recheck", "alice/a", "--token", SECRET)
    assert result.exit_code == 0 and fake_recheck["token"] == SECRET and SECRET not in result.output
    result = invoke("recheck", "alice/a", env={"HF_TOKEN": SECRET})
    assert result.exit_code == 0 and fake_recheck["token"] == SECRET and SECRET not in result.output


def test_recheck_compat(fake_recheck: dict[str, Any]) -> None:
    assert invoke("recheck", "alice/a").exit_code == 0 and fake_recheck["compat"] == ()  # the default matrix
    assert invoke("recheck", "alice/a", "--compat", "latest").exit_code == 0 and fake_recheck["compat"] == ("latest",)
    assert invoke("recheck", "alice/a", env={"HF_AO_PUBLISH_COMPAT": "latest"}).exit_code == 0
    assert fake_recheck["compat"] == ("latest",)


def test_recheck_json(fake_recheck: dict[str, Any]) -> None:
    fake_recheck["fail"].add("alice/gone")
    result = invoke("recheck", "alice/a", "alice/gone", "--json")
    assert result.exit_code == 1  # one repo could not be rechecked; the other was
    data = json.loads(result.stdout)
    assert [r["repo"] for r in data["repos"]] == ["alice/a", "alice/gone"] and data["repos"][0]["changes"] == []
    assert data["repos"][1] == {"repo": "alice/gone", "error": "repo alice/gone not found"}
    assert data["error"] == "1 of 2 repos could not be rechecked" and data["exit_code"] == 1


def test_recheck_debug(fake_recheck: dict[str, Any]) -> None:
    from publisher.errors import SourceError

    fake_recheck["fail"].add("alice/gone")
    result = invoke("recheck", "alice/gone")
    assert result.exit_code == 1 and "alice/gone: FAILED: repo alice/gone not found" in result.stderr
    assert "Traceback" not in result.output
    with pytest.raises(SourceError, match="not found"):  # --debug: the real exception
        invoke("recheck", "alice/gone", "--debug")


def test_recheck_quiet(fake_recheck: dict[str, Any]) -> None:
    loud = invoke("recheck", "alice/a")
    assert "info from the recheck" in loud.stderr and "rechecking alice/a" in loud.stderr
    quiet = invoke("recheck", "alice/a", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr.splitlines() == ["warning from the recheck"]
    assert quiet.stdout == loud.stdout  # the table: data


def test_verify_json(fake_verify: dict[str, Any]) -> None:
    result = invoke("verify", "alice/x", "--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["passed"] is True and data["location"] == "alice/x"
    assert data["results"][0]["component"] == "transformer"


def test_verify_debug(fake_verify: dict[str, Any]) -> None:
    fake_verify["raise"] = SourceError("alice/x has no torchao component; check the id")
    result = invoke("verify", "alice/x")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "Error: alice/x has no torchao component; check the id"
    assert "Traceback" not in result.output
    with pytest.raises(SourceError, match="has no torchao component"):  # --debug: the real exception, with its traceback
        invoke("verify", "alice/x", "--debug")


def test_verify_quiet(fake_verify: dict[str, Any]) -> None:
    loud = invoke("verify", "alice/x")
    assert "info from the verification" in loud.stderr and "warning from the verification" in loud.stderr
    assert "alice/x: all " in loud.stderr and "verifying alice/x:" in loud.stderr
    quiet = invoke("verify", "alice/x", "--quiet")
    assert quiet.exit_code == 0
    assert "info from the verification" not in quiet.stderr and "warning from the verification" in quiet.stderr
    assert quiet.stderr.splitlines() == ["warning from the verification"]  # no plan line, no summary line
    assert quiet.stdout == loud.stdout  # the report table: data


# ---------------------------------------------------------------- publish (job.run replaced by a recorder)

@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[PublishRequest]:
    """Replace the publish job with a recorder; each call appends its request and returns one
    verified, unpushed outcome per recipe (a recipe named "broken" fails)."""
    from publisher import job

    seen: list[PublishRequest] = []

    def run(req: PublishRequest) -> list[Outcome]:
        seen.append(req)
        logging.getLogger("publisher.job").info("info from the job")
        logging.getLogger("publisher.job").warning("warning from the job")
        names = [n for value in req.make.quant for n in value.split(",")]
        return [Outcome(recipe=n, repo_id=f"alice/m-{n}", folder=tmp_path / n, verified=n != "broken",
                        error="injected" if n == "broken" else None) for n in names]

    monkeypatch.setattr(job, "run", run)
    return seen


def publish(*args: str, env: dict[str, str] | None = None) -> Result:
    return invoke("some/model", "--quant", "int8wo", *args, env=env)


def test_publish_help() -> None:
    for args in (["publish", "--help"], ["some/model", "--help"], ["publish", "-h"]):
        result = invoke(*args)
        assert result.exit_code == 0
        assert result.stdout.startswith("Usage: hf-ao-publish publish [OPTIONS] MODEL_ID")
    flat = " ".join(result.stdout.split()).replace("- ", "-")  # click may wrap after a hyphen (int8dq-int4)
    assert "--quant RECIPE|CONFIG" in result.stdout and ", ".join(recipe_registry.names()) in flat


def test_publish_model_id(fake_run: list[PublishRequest], tmp_path: Path) -> None:
    for args in (["some/model"], ["publish", "some/model"]):
        result = invoke(*args, "--quant", "int8wo")
        assert result.exit_code == 0, result.output
        assert fake_run[-1].base.model == "some/model"
        assert result.stdout == f"{tmp_path / 'int8wo'}\n"
        assert f"int8wo: verified repo folder at {tmp_path / 'int8wo'}" in result.stderr
    assert invoke("publish", "--quant", "int8wo").exit_code == 2


def test_publish_model_id_several_need_on_hf_jobs(fake_run: list[PublishRequest], monkeypatch: pytest.MonkeyPatch) -> None:
    refused = invoke("some/model", "other/model", "--quant", "int8wo")
    assert refused.exit_code == 2 and not fake_run
    assert ("several MODEL_IDs are published on Hugging Face Jobs, one job per model and recipe; add --on-hf-jobs FLAVOR, "
            "or publish one model per command") in refused.stderr
    from publisher.hfjobs import remote

    seen: list[Any] = []
    monkeypatch.setattr(remote, "publish_all", lambda requests: seen.extend(requests) or [])
    result = invoke("a/one", "b/two", "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", "--repo-id", "alice/{model}-x")
    assert result.exit_code == 0, result.output
    assert [(r.publish.base.model, r.publish.target.repo_id, r.flavor) for r in seen] == [("a/one", "alice/one-x", "cpu-basic"),
                                                                              ("b/two", "alice/two-x", "cpu-basic")]


def test_publish_model_id_of_a_local_folder_in_the_card_command(fake_run: list[PublishRequest], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The card's command line names a local base as typed when that is a path below the working directory, else by
    the folder's own name: never where it sat on this machine."""
    base = tmp_path / "home" / "alice" / "my-pipeline"
    (base / "sub").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home" / "alice"))
    monkeypatch.chdir(base.parent)
    for typed, shown in (("./my-pipeline", "./my-pipeline"), ("my-pipeline/sub", "my-pipeline/sub"),
                         (str(base), "my-pipeline"), ("../alice/my-pipeline", "my-pipeline"), ("~/my-pipeline", "my-pipeline"),
                         ("my-pipeline/sub/..", "my-pipeline"), ("some/model", "some/model")):
        assert invoke(typed, "--quant", "int8wo").exit_code == 0
        assert fake_run[-1].base.model == typed and fake_run[-1].command == f"hf-ao-publish {shown} --quant int8wo", typed
    monkeypatch.chdir(base)
    assert invoke(".", "--quant", "int8wo").exit_code == 0 and fake_run[-1].command.startswith("hf-ao-publish my-pipeline ")


def test_publish_quant(fake_run: list[PublishRequest]) -> None:
    assert publish("--quant", "float8wo,int8dq").exit_code == 0
    assert fake_run[-1].make.quant == ["int8wo", "float8wo,int8dq"]
    result = invoke("some/model")
    assert result.exit_code == 2 and "Missing option '--quant'" in result.stderr


def test_publish_quant_named_twice_is_said() -> None:
    result = publish("--quant", "int8wo,float8wo")  # the real job's checks: it stops at the missing token
    assert result.exit_code == 1
    assert "--quant names int8wo more than once; it is published once" in result.stderr
    assert "float8wo more than once" not in result.stderr


def test_publish_unknown_recipe_is_a_usage_error() -> None:
    # the real job: the recipe is checked before anything is read
    result = invoke("some/model", "--quant", "int3", "--no-push")
    assert result.exit_code == 2
    assert "unknown recipe 'int3' (did you mean int8wo?); choose one of: " + ", ".join(recipe_registry.names()) in result.stderr


def test_publish_quant_takes_configs_and_mappings(fake_run: list[PublishRequest]) -> None:
    # passed on as given: the job splits them on top-level commas only (tests/test_configs.py)
    call = "IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))"
    assert invoke("some/model", "--quant", call, "--quant", "transformer=float8wo,text_encoder_2=int8wo").exit_code == 0
    assert fake_run[-1].make.quant == [call, "transformer=float8wo,text_encoder_2=int8wo"]


def test_publish_rejected_config_is_a_usage_error_with_the_working_form(tiny_flux_dir: Path, tmp_path: Path) -> None:
    # the real job: torchao's own refusal (a bare AssertionError in 0.18) becomes one line, before any weight is read
    result = invoke(str(tiny_flux_dir), "--quant", "Int8WeightOnlyConfig(group_size=128, version=2)", "--no-push",
                    "--output-dir", str(tmp_path / "out"))
    assert result.exit_code == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("Error: --quant 'Int8WeightOnlyConfig(group_size=128, version=2)': torchao rejects")
    assert "Use granularity=PerGroup(128) instead." in line
    assert line.endswith("the working form: Int8WeightOnlyConfig(granularity=PerGroup(128))")
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_publish_layer_config(fake_run: list[PublishRequest], tmp_path: Path) -> None:
    table = tmp_path / "layers.json"
    table.write_text('{"re:.*attn.*": "int8wo", "proj_out": null}')
    assert publish("--layer-config", str(table), "--layer-config", 'text_encoder_2={"re:.*": null}').exit_code == 0
    assert fake_run[-1].make.layer_config == [str(table), 'text_encoder_2={"re:.*": null}']


def test_publish_layer_config_that_is_no_object_is_a_usage_error(tmp_path: Path) -> None:
    # the real job: a table that is no JSON object fails before anything is read, naming the option
    table = tmp_path / "layers.json"
    table.write_text("[1, 2]")
    result = invoke("some/model", "--quant", "int8wo", "--layer-config", str(table), "--no-push")
    assert result.exit_code == 2 and "--layer-config" in result.stderr and "JSON object" in result.stderr


def test_publish_components(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].base.components is None
    assert publish("--components", "transformer, text_encoder_2,").exit_code == 0
    assert fake_run[-1].base.components == ["transformer", "text_encoder_2"]


def test_publish_exclude(fake_run: list[PublishRequest]) -> None:
    assert publish("--exclude", "proj_out", "--exclude", "norm_out.linear").exit_code == 0
    assert fake_run[-1].base.exclude == ["proj_out", "norm_out.linear"]


def test_publish_repo_id(fake_run: list[PublishRequest]) -> None:
    assert publish("--repo-id", "acme/m-{recipe}").exit_code == 0
    assert fake_run[-1].target.repo_id == "acme/m-{recipe}"


def test_publish_malformed_repo_id_is_a_usage_error() -> None:
    result = invoke("some/model", "--quant", "int8wo", "--no-push", "--repo-id", "no-namespace")  # the real job
    assert result.exit_code == 2
    assert "--repo-id 'no-namespace' is not a valid Hub repo id" in result.stderr


def test_publish_revision(fake_run: list[PublishRequest]) -> None:
    assert publish("--revision", "refs/pr/1").exit_code == 0
    assert fake_run[-1].base.revision == "refs/pr/1"


def test_publish_private(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].target.private is False
    assert publish("--private").exit_code == 0 and fake_run[-1].target.private is True


def test_publish_token(fake_run: list[PublishRequest]) -> None:
    result = publish("--token", SECRET, "--repo-id", "alice/m")
    assert result.exit_code == 0 and fake_run[-1].token == SECRET
    assert SECRET not in result.output and SECRET not in fake_run[-1].command
    assert SECRET not in repr(fake_run[-1])
    result = publish(env={"HF_TOKEN": SECRET})
    assert result.exit_code == 0 and fake_run[-1].token == SECRET and SECRET not in result.output


def test_publish_without_a_token_cannot_push() -> None:
    result = invoke("some/model", "--quant", "int8wo")  # the real job, no token anywhere (conftest)
    assert result.exit_code == 1
    assert "pushing needs a Hub token" in result.stderr


def test_publish_output_dir(fake_run: list[PublishRequest], tmp_path: Path) -> None:
    assert publish("--output-dir", str(tmp_path / "out")).exit_code == 0
    assert fake_run[-1].target.output_dir == tmp_path / "out"
    assert "--output-dir" not in fake_run[-1].command  # a local path says nothing about the published bytes


def test_publish_output_dir_must_be_a_new_or_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    result = invoke("some/model", "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path / "file"))
    assert result.exit_code == 2 and f"Directory '{tmp_path / 'file'}' is a file" in result.stderr
    result = invoke("some/model", "--quant", "int8wo", "--no-push", "--output-dir", str(tmp_path))  # the real job
    assert result.exit_code == 1
    assert f"--output-dir {tmp_path} is not empty; choose an empty or new folder" in result.stderr


def test_publish_no_push(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].target.push is True
    assert publish("--no-push").exit_code == 0 and fake_run[-1].target.push is False


def test_publish_create_pr(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].target.create_pr is False
    assert publish("--create-pr").exit_code == 0 and fake_run[-1].target.create_pr is True


def test_publish_trust_remote_code(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].base.trust_remote_code is False
    assert publish("--trust-remote-code").exit_code == 0 and fake_run[-1].base.trust_remote_code is True


def test_publish_keep_going(fake_run: list[PublishRequest]) -> None:
    result = publish("--quant", "broken", "--keep-going")
    assert fake_run[-1].keep_going is True
    assert result.exit_code == 1
    assert "broken: FAILED: injected" in result.stderr
    assert result.stderr.splitlines()[-1] == "Error: 1 of 2 recipes failed"


def test_publish_verify_env(fake_run: list[PublishRequest]) -> None:
    assert publish("--verify-env", "/venv-a/bin/python", "--verify-env", "/venv-b/bin/python").exit_code == 0
    assert fake_run[-1].checks.verify_envs == ("/venv-a/bin/python", "/venv-b/bin/python")
    assert fake_run[-1].checks.verify_mode == "full"  # whole reloads in the other interpreters
    result = publish("--verify-env", "/venv-a/bin/python", "--verify-mode", "streaming")
    assert result.exit_code == 2 and "--verify-env reloads whole components" in result.stderr


def test_publish_compat(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0
    assert fake_run[-1].checks.compat == ()  # the default matrix
    assert publish(env={"HF_AO_PUBLISH_COMPAT": "none"}).exit_code == 0 and fake_run[-1].checks.compat == ("none",)  # the variable
    assert "--compat" not in fake_run[-2].command  # the default: not in the card's command line
    assert "--compat" not in fake_run[-1].command  # nor the variable's value: not typed
    assert publish("--compat", "default", "--compat", "diffusers==0.40.0").exit_code == 0
    assert fake_run[-1].checks.compat == ("default", "diffusers==0.40.0")
    assert "--compat default --compat diffusers==0.40.0" in fake_run[-1].command
    result = publish("--compat", "diffusers==0.40.0", "--verify-mode", "streaming")
    assert result.exit_code == 2 and "--compat environments reload whole components" in result.stderr
    assert publish("--compat", "none", "--verify-mode", "streaming").exit_code == 0


def test_publish_verify_env_takes_specs(fake_run: list[PublishRequest]) -> None:
    assert publish("--verify-env", "diffusers==0.39.0").exit_code == 0
    assert fake_run[-1].checks.verify_envs == ("diffusers==0.39.0",)


def test_publish_sample_prompt(fake_run: list[PublishRequest]) -> None:
    assert publish("--sample-prompt", "a red fox").exit_code == 0
    assert fake_run[-1].checks.sample_prompt == "a red fox"


def test_publish_sample_steps(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].checks.sample_steps == 28
    assert publish("--sample-steps", "2").exit_code == 0 and fake_run[-1].checks.sample_steps == 2
    result = publish("--sample-steps", "0")
    assert result.exit_code == 2 and "--sample-steps" in result.stderr


def test_publish_sample_size(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].checks.sample_size == 1024
    assert publish("--sample-size", "64").exit_code == 0 and fake_run[-1].checks.sample_size == 64
    result = publish("--sample-size", "8")
    assert result.exit_code == 2 and "--sample-size" in result.stderr


def test_publish_eval_dataset(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0
    ev = fake_run[-1].checks.evaluation
    assert ev is not None and ev.dataset.text() == "Salesforce/wikitext:wikitext-2-raw-v1:test" and not ev.explicit_dataset
    assert publish("--eval-budget", "5m", "--eval-dataset", "me/text:cfg").exit_code == 0
    ev = fake_run[-1].checks.evaluation
    assert ev is not None and ev.explicit_dataset and (ev.dataset.repo, ev.dataset.config, ev.dataset.split) == ("me/text", "cfg", "test")
    result = publish("--eval-budget", "5m", "--eval-dataset", "me/text::x")
    assert result.exit_code == 2 and "--eval-dataset 'me/text::x' is not REPO[:CONFIG][:SPLIT]" in result.stderr


def test_publish_eval_tokens(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].checks.evaluation.tokens == 1024  # type: ignore[union-attr]
    assert publish("--eval-tokens", "256").exit_code == 0 and fake_run[-1].checks.evaluation.tokens == 256  # type: ignore[union-attr]
    result = publish("--eval-tokens", "3")
    assert result.exit_code == 2 and "--eval-tokens" in result.stderr


def test_publish_eval_budget(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].checks.evaluation.budget_s is None  # type: ignore[union-attr]  # the default: auto
    assert publish(env={"HF_AO_PUBLISH_EVAL_BUDGET": "0"}).exit_code == 0
    assert fake_run[-1].checks.evaluation.budget_s == 0  # type: ignore[union-attr]  # the variable's value
    assert publish("--eval-budget", "1h").exit_code == 0 and fake_run[-1].checks.evaluation.budget_s == 3600  # type: ignore[union-attr]
    assert "--eval-budget" not in fake_run[-3].command and "--eval-budget" not in fake_run[-2].command  # default, variable
    assert "--eval-budget 1h" in fake_run[-1].command
    result = publish("--eval-budget", "soon")
    assert result.exit_code == 2 and "--eval-budget 'soon' is not a duration" in result.stderr
    assert "HF_AO_PUBLISH_EVAL_BUDGET" in invoke("publish", "--help").stdout


def test_publish_min_quality(fake_run: list[PublishRequest]) -> None:
    assert publish("--eval-budget", "5m", "--min-quality", "ppl-recovery=95", "--min-quality", "psnr=30").exit_code == 0
    assert [b.text() for b in fake_run[-1].checks.evaluation.bounds] == ["ppl-recovery=95", "psnr=30"]  # type: ignore[union-attr]
    assert publish("--eval-budget", "5m", "--min-quality", "lpips=0.1").exit_code == 0  # an upper bound (lower is closer)
    assert [b.text() for b in fake_run[-1].checks.evaluation.bounds] == ["lpips=0.1"]  # type: ignore[union-attr]
    result = publish("--eval-budget", "5m", "--min-quality", "fid=3")
    assert result.exit_code == 2 and "'fid=3' is not METRIC=VALUE with METRIC one of ppl-recovery, psnr, ssim, lpips" in result.stderr
    for result in (publish("--eval-budget", "0", "--min-quality", "psnr=30"),
                   publish("--min-quality", "psnr=30", env={"HF_AO_PUBLISH_EVAL_BUDGET": "0"})):
        assert result.exit_code == 2 and "--min-quality needs the quality evaluation, which --eval-budget 0 turns off" in result.stderr


def test_publish_eval_full_images(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].checks.evaluation.full_images is False  # type: ignore[union-attr]
    assert publish("--eval-full-images").exit_code == 0 and fake_run[-1].checks.evaluation.full_images is True  # type: ignore[union-attr]
    assert "--eval-full-images" in fake_run[-1].command  # the card's command line: it changes what the repo holds
    result = publish("--eval-full-images", "--eval-budget", "0")
    assert result.exit_code == 2 and "--eval-budget 0" in result.stderr


def test_publish_allow_unquantized(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].make.allow_unquantized is False
    assert publish("--allow-unquantized").exit_code == 0 and fake_run[-1].make.allow_unquantized is True
    assert "--allow-unquantized" in fake_run[-1].command  # the card's command line says it was accepted


def test_publish_benchmark(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].checks.benchmark is False
    assert publish("--benchmark").exit_code == 0 and fake_run[-1].checks.benchmark is True
    result = publish("--benchmark", "--low-disk")
    assert result.exit_code == 2 and "--low-disk does not download" in result.stderr


def test_publish_force(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].target.force is False
    assert publish("--force").exit_code == 0 and fake_run[-1].target.force is True
    assert "--force" not in fake_run[-1].command  # the card's command line: --force changes no published byte


def test_publish_engine(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].make.engine == "auto"
    assert publish("--engine", "library").exit_code == 0 and fake_run[-1].make.engine == "library"
    result = publish("--engine", "fast")
    assert result.exit_code == 2 and "'fast' is not one of 'auto', 'streaming', 'library'" in result.stderr


def test_publish_low_disk(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].target.low_disk is None
    assert publish("--low-disk").exit_code == 0 and fake_run[-1].target.low_disk is True
    assert publish("--no-low-disk").exit_code == 0 and fake_run[-1].target.low_disk is False
    result = publish("--low-disk", "--engine", "library")
    assert result.exit_code == 2 and "only the streaming engine does" in result.stderr


def test_publish_max_shard_size(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].make.max_shard_size is None
    assert publish("--max-shard-size", "500MB").exit_code == 0 and fake_run[-1].make.max_shard_size == "500MB"
    result = publish("--max-shard-size", "huge")
    assert result.exit_code == 2 and "--max-shard-size 'huge' is not a size" in result.stderr


def test_publish_recheck_published(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].target.recheck_published is False
    assert publish("--recheck-published").exit_code == 0 and fake_run[-1].target.recheck_published is True


def test_publish_verify_mode(fake_run: list[PublishRequest]) -> None:
    assert publish().exit_code == 0 and fake_run[-1].checks.verify_mode == "auto"
    assert publish("--verify-mode", "streaming").exit_code == 0 and fake_run[-1].checks.verify_mode == "streaming"
    assert publish("--verify-mode", "sometimes").exit_code == 2


def test_publish_json(fake_run: list[PublishRequest], tmp_path: Path) -> None:
    result = publish("--json")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["recipe"] == "int8wo" and data["repo_id"] == "alice/m-int8wo" and data["verified"] is True
    assert data["folder"] == str(tmp_path / "int8wo")
    result = publish("--quant", "float8wo", "--json")
    data = json.loads(result.stdout)
    assert [r["recipe"] for r in data["results"]] == ["int8wo", "float8wo"] and data["verified"] is True


def test_publish_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    from publisher import job

    def run(req: PublishRequest) -> list[Outcome]:
        raise TargetError("cannot write to the namespace 'bob'; use a token of bob")

    monkeypatch.setattr(job, "run", run)
    result = publish()
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == "Error: cannot write to the namespace 'bob'; use a token of bob"
    with pytest.raises(TargetError, match="namespace 'bob'"):
        publish("--debug")


def test_publish_quiet(fake_run: list[PublishRequest]) -> None:
    loud = publish()
    assert "info from the job" in loud.stderr and "warning from the job" in loud.stderr
    assert "int8wo: verified repo folder at " in loud.stderr
    quiet = publish("--quiet")
    assert quiet.exit_code == 0
    assert "info from the job" not in quiet.stderr and "warning from the job" in quiet.stderr
    assert quiet.stderr.splitlines() == ["warning from the job"]  # no summary line: the result is on stdout
    assert quiet.stdout == loud.stdout


def test_publish_records_the_command_without_secrets_or_local_paths(fake_run: list[PublishRequest], tmp_path: Path) -> None:
    assert publish("--repo-id", "acme/m", "--token", SECRET, "--output-dir", str(tmp_path / "o"), "--json",
                   "--quiet", *SMALL).exit_code == 0
    assert fake_run[-1].command == "hf-ao-publish some/model --quant int8wo --repo-id acme/m --sample-steps 2 --sample-size 64"


# ---------------------------------------------------------------- Hugging Face Jobs (the remote run replaced by a recorder)

@pytest.fixture
def fake_remote(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace remote.publish / remote.attach with recorders returning one finished job per recipe."""
    from publisher.hfjobs import remote
    from publisher.hfjobs.follow import RemoteOutcome

    seen: list[Any] = []

    def outcome(recipe: str) -> RemoteOutcome:
        result = {"recipe": recipe, "repo_id": f"alice/m-{recipe}", "url": f"http://hub/alice/m-{recipe}",
                  "commit": "c" * 40, "pr_url": None, "verified": True, "pushed": True, "up_to_date": False, "error": None}
        return RemoteOutcome(recipe, f"alice/m-{recipe}", "j1", "http://hub/jobs/alice/j1", "l4x1", "COMPLETED",
                             0, result)

    def publish(request: remote.JobsRequest) -> list[RemoteOutcome]:
        seen.append(request)
        return [outcome(n) for value in request.publish.make.quant for n in value.split(",")]

    def attach(job_ids: list[str], token: str | None, keep_going: bool = True) -> list[RemoteOutcome]:
        seen.append((job_ids, token, keep_going))
        return [outcome("int8wo")]

    monkeypatch.setattr(remote, "publish", publish)
    monkeypatch.setattr(remote, "attach", attach)
    return seen


def test_publish_on_hf_jobs(fake_remote: list[Any]) -> None:
    result = publish("--on-hf-jobs", "l4x1", "--components", "transformer", *SMALL, "--token", SECRET, "--quiet")
    assert result.exit_code == 0, result.output
    request = fake_remote[-1]
    assert request.flavor == "l4x1" and request.publish.base.model == "some/model" and request.publish.make.quant == ["int8wo"]
    # what every job's command repeats: no token, no recipe/target/revision (set per job), no local-only option
    assert request.options == ("--components", "transformer", "--sample-steps", "2", "--sample-size", "64", "--quiet")
    loud = publish("--on-hf-jobs", "l4x1", "--no-low-disk")
    assert loud.exit_code == 0
    assert fake_remote[-1].options == ("--no-low-disk",)  # an explicit "no" reaches the job too
    assert result.stdout == loud.stdout == "http://hub/alice/m-int8wo\n"
    assert result.stderr == ""  # --quiet: the result on stdout, no summary line
    assert "published alice/m-int8wo: http://hub/alice/m-int8wo" in loud.stderr
    for extra, flag in ((["--no-push"], "--no-push"), (["--output-dir", "out"], "--output-dir"),
                        (["--verify-env", "/x/python"], "--verify-env")):
        refused = publish("--on-hf-jobs", "l4x1", *extra)
        assert refused.exit_code == 2 and f"{flag} needs this machine's disk or interpreters" in refused.stderr


def test_publish_hf_jobs_timeout(fake_remote: list[Any]) -> None:
    assert publish("--on-hf-jobs", "l4x1").exit_code == 0 and fake_remote[-1].timeout == "2h"
    assert publish("--on-hf-jobs", "l4x1", "--hf-jobs-timeout", "90m").exit_code == 0
    assert fake_remote[-1].timeout == "90m" and "90m" not in " ".join(fake_remote[-1].options)
    bad = publish("--on-hf-jobs", "l4x1", "--hf-jobs-timeout", "soon")
    assert bad.exit_code == 2 and "'soon' is not a duration" in bad.stderr
    alone = publish("--hf-jobs-timeout", "90m")
    assert alone.exit_code == 2 and "--hf-jobs-timeout applies to --on-hf-jobs" in alone.stderr


def test_publish_attach(fake_remote: list[Any]) -> None:
    result = invoke("--attach", "j1", "--attach", "j2", "--json", env={"HF_TOKEN": SECRET})
    assert result.exit_code == 0, result.output
    assert fake_remote[-1] == (["j1", "j2"], SECRET, False)
    assert json.loads(result.stdout)["commit"] == "c" * 40
    both = invoke("some/model", "--quant", "int8wo", "--attach", "j1")
    assert both.exit_code == 2 and "give it without MODEL_ID, --quant and --on-hf-jobs" in both.stderr
    assert "Missing argument 'MODEL_ID...'" in invoke("publish").stderr  # still required without --attach


# ---------------------------------------------------------------- library noise

# Lines a successful run printed before the filter (torch 2.13, torchao 0.18, diffusers 0.42).
NOISE = [
    ("torchao", ("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                 "Could not load this library: /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so")),
    ("torchao", ("Failed to load /venv/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this library: "
                 "/venv/site-packages/torchao/_C_cutlass_90a.abi3.so")),
    ("torchao.kernel.intmm", "Warning: Detected no triton, on systems without Triton certain kernels will not work"),
    ("torch.utils._pytree", ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                             "torch.compile as an opaque value type. Calling register_constant() on Enum subclasses "
                             "is deprecated and will be an error in a future release.")),
    ("diffusers.quantizers.torchao.torchao_quantizer",
     "Unable to import `torchao` Tensor objects. This may affect loading checkpoints serialized with `torchao`"),
    ("transformers.utils.import_utils",
     "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` for backward "
     "compatibility. Install torchvision to use the default backend, or import `CLIPImageProcessorPil` directly to "
     "silence this warning."),
]
NOISE_MARKS = ("Failed to load", "Detected no triton", "register_constant()", "Unable to import `torchao` Tensor objects",
               "requires torchvision", "is deprecated")


def _third_party(stderr: str) -> list[str]:
    """Lines of a library rather than ours: a library logger's prefix, a Python warning, torch's own log format, or a
    known noise mark."""
    prefixes = tuple(f"{name}{sep}" for name in logs.LIBRARIES for sep in (".", ":"))
    return [line for line in stderr.splitlines()
            if line.startswith(prefixes) or re.search(r"\b[A-Z]\w*Warning\b|^[WEI]\d{4} ", line)
            or any(mark in line for mark in NOISE_MARKS)]


@pytest.mark.parametrize("debug", [False, True])
def test_known_library_noise_is_hidden_unless_debug(capsys: pytest.CaptureFixture[str], debug: bool) -> None:
    logs.setup(debug=debug)
    for name, message in NOISE:
        logging.getLogger(name).warning(message)
    # the same loggers keep saying what is not on the list
    logging.getLogger("torchao").warning("Failed to load /venv/site-packages/torchao/_C.abi3.so: undefined symbol")
    logging.getLogger("diffusers.models.modeling_utils").warning("some weights were not used")
    err = capsys.readouterr().err
    assert "torchao: Failed to load /venv/site-packages/torchao/_C.abi3.so: undefined symbol" in err
    assert "diffusers.models.modeling_utils: some weights were not used" in err
    for name, message in NOISE:
        assert (f"{name}: {message}" in err) is debug


@pytest.mark.slow  # two fresh interpreters importing torch, torchao, diffusers and transformers
def test_library_loggers_keep_our_handler_whoever_is_imported_first() -> None:
    code = ("import logging, sys\nfrom publisher.runtime import logs\n"
            "import huggingface_hub\nlogs.setup(debug='-d' in sys.argv)\n"
            "import torchao, diffusers.quantizers.torchao.torchao_quantizer, transformers\n"
            "from diffusers.utils import logging as dl\ndl.get_logger('diffusers.x').warning('diffusers says')\n"
            "from transformers.utils import logging as tl\ntl.get_logger('transformers.x').warning('transformers says')\n"
            "print(sorted({type(h).__name__ for n in logs.LIBRARIES for h in logging.getLogger(n).handlers}))\n")
    quiet = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "['_Stderr']"
    assert quiet.stderr.splitlines() == ["diffusers.x: diffusers says", "transformers.x: transformers says"]
    debug = subprocess.run([sys.executable, "-c", code, "-d"], check=False, capture_output=True, text=True, timeout=300)
    assert any(mark in debug.stderr for mark in NOISE_MARKS), debug.stderr


@pytest.mark.parametrize("category", [SyntaxWarning, DeprecationWarning])  # Python 3.12 and later; 3.11
def test_torchaos_invalid_escape_sequence_warning_is_hidden(category: type[Warning]) -> None:
    """torchao 0.18's quant_api.py has a "\\." in a plain string: Python warns the first time it compiles the file.
    The filter is by module, set before torchao is imported; the same warning from any other module still shows."""
    import warnings

    site = "/venv/lib/python3.12/site-packages"
    ours, other = f"{site}/torchao/quantization/quant_api.py", f"{site}/other/quant_api.py"
    compiled = SyntaxWarning if sys.version_info >= (3, 12) else DeprecationWarning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # as with -W always: every warning shown unless a filter drops it
        logs.filter_warnings()
        for filename in (ours, other):  # raised as the compiler raises it: the module named by its file
            warnings.warn_explicit("invalid escape sequence '\\.'", category, filename, 1542)
        warnings.warn_explicit("invalid escape sequence '\\.'", category, "quant_api.py", 1,
                               module="torchao.quantization.quant_api")  # by module name, at run time
        for filename in (ours, other):  # and by this Python's compiler itself
            compile("pattern = '\\.'\n", filename, "exec")
    assert [(w.category, w.filename) for w in seen] == [(category, other), (compiled, other)]


@pytest.mark.slow  # imports torchao (the registry's facts), which warns at import
def test_recipes_hides_the_library_noise_as_publish_does() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the built-in flavor table: no Hub asked
    proc = subprocess.run([sys.executable, "-m", "publisher.cli", "recipes"], env=env, check=False, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "int8wo  int8 weight-only" in proc.stdout
    assert proc.stderr == ""  # torchao's optional kernels and torch's pytree deprecation: known-harmless, hidden


@pytest.mark.slow
def test_a_successful_publish_prints_no_library_noise(tiny_flux_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in PROGRESS_VARS}  # as a user's CI runs it: a pipe, no setting

    def run(out: str, *extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "publisher.cli", str(tiny_flux_dir), "--quant", "int8wo", "--no-push",
               "--output-dir", str(tmp_path / out), *SMALL, *SKIP_EVAL_AND_MATRIX, *extra]
        proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    clean = run("out")
    assert clean.stdout == f"{tmp_path / 'out'}\n"
    assert not _third_party(clean.stderr), clean.stderr
    assert not progress_bars(clean.stderr), clean.stderr  # "Loading weights", our "quantize ..." bar: none in a log
    assert "int8wo: verified repo folder at" in clean.stderr
    # the import-time lines are enough to see the filter lifted: no fresh-process reloads needed for that
    debug = run("debug", "--debug", *IN_PROCESS)
    shown = [line for line in debug.stderr.splitlines() if any(mark in line for mark in NOISE_MARKS)]
    assert shown  # --debug shows what the filter hides (which lines depends on the machine)
    assert all(logs.is_harmless(logging.makeLogRecord({"name": line.split(": ", 1)[0], "msg": line.split(": ", 1)[1]}))
               for line in shown), shown
