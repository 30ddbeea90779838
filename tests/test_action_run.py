"""action/run.py: the publish step around a stand-in CLI (fast); the real CLI runs in test_action.py.

The stand-in is an executable `hf-ao-publish` next to HFAO_PYTHON, where the step looks first. It records
its argv and environment in its JSON result, writes a card into --output-dir and behaves as FAKE_MODE says.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from action_harness import parse_commands, parse_output_file, sample_result

from action.run import CliRun, cli_command, failure_message, run

ROOT = Path(__file__).resolve().parents[1]

FAKE_CLI = f"""#!{sys.executable}
import json, os, sys
mode = os.environ["FAKE_MODE"]
if sys.argv[1] == "recheck":  # no --output-dir: it publishes nothing
    result = json.loads(os.environ["FAKE_RESULT"])
    result["argv"] = sys.argv[1:]
    print(json.dumps(result))
    sys.exit(1 if any(r.get("error") for r in result["repos"]) else 0)
out = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--output-dir="))
print("working with " + os.environ.get("HF_TOKEN", "no token"), file=sys.stderr)
print("::add-path::/evil", file=sys.stderr)
if mode == "fail":
    print("Error: boom for " + os.environ.get("HF_TOKEN", ""), file=sys.stderr)
    sys.exit(1)
if mode == "wait":  # record every signal received and the session we run in; end like the CLI does on a signal
    import signal, time
    got = []
    signal.signal(signal.SIGINT, lambda n, f: got.append(n))
    signal.signal(signal.SIGTERM, lambda n, f: got.append(n))
    time.sleep(2.0)  # the step's forwarding is in place by now (a loaded CI machine starts threads late)
    open(os.environ["FAKE_READY"], "w").write(str(os.getsid(0)))
    while not got:
        time.sleep(0.01)
    time.sleep(0.5)  # a second copy of the signal, if one were on its way, arrives meanwhile
    open(os.environ["FAKE_READY"], "a").write(" " + ",".join(str(n) for n in got))
    print("Error: interrupted by SIG%s: cleaned up" % ("INT" if got[0] == signal.SIGINT else "TERM"), file=sys.stderr)
    sys.exit(128 + got[0])
card = os.path.join(out, "README.md")
with open(card, "w") as fh:
    fh.write("# card of alice/m-int8wo\\n")
result = json.loads(os.environ["FAKE_RESULT"])
result.update(card_path=card, argv=sys.argv[1:], hfao=sorted(k for k in os.environ if k.startswith("HFAO_")))
print(json.dumps(result))
"""


@pytest.fixture
def step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The run step's environment, with the stand-in CLI installed next to HFAO_PYTHON."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "hf-ao-publish"
    script.write_text(FAKE_CLI)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "runner_temp").mkdir()
    return {"PATH": os.environ.get("PATH", ""), "HFAO_PYTHON": str(bin_dir / "python"), "HFAO_MODEL": "bfl/tiny-flux",
            "HFAO_QUANT": "int8wo", "HFAO_TOKEN": "tok_x", "RUNNER_TEMP": str(tmp_path / "runner_temp"),
            "GITHUB_OUTPUT": str(tmp_path / "output"), "GITHUB_STEP_SUMMARY": str(tmp_path / "summary"),
            "FAKE_MODE": "ok", "FAKE_RESULT": json.dumps(sample_result())}


def test_run_publishes_and_cleans_up(step: dict[str, str], capfd: pytest.CaptureFixture[str]) -> None:
    assert run(step) == 0
    out, err = capfd.readouterr()
    outputs = parse_output_file(Path(step["GITHUB_OUTPUT"]))
    assert outputs["repo-id"] == "alice/m-int8wo" and outputs["verified"] == "true" and outputs["output-dir"] == ""
    result = json.loads(outputs["result-json"])
    assert result["argv"][:3] == ["publish", "bfl/tiny-flux", "--quant=int8wo"] and result["argv"][-2] == "--json"
    out_dir = Path(result["argv"][-1].split("=", 1)[1])
    assert out_dir.parent == Path(step["RUNNER_TEMP"]) and not out_dir.exists()  # pushed: the folder is gone
    assert result["hfao"] == []  # the CLI sees HF_TOKEN, never the raw inputs
    assert "working with ***" in err and "tok_x" not in err + out.replace("::add-mask::tok_x", "")
    assert [c.name for c in parse_commands(out)] == ["add-mask", "group", "endgroup"]  # ::add-path:: was stopped
    summary = Path(step["GITHUB_STEP_SUMMARY"]).read_text()
    assert "## ✅ hf-ao-publish: `bfl/tiny-flux`" in summary and "# card of alice/m-int8wo" in summary


def test_run_rechecks_published_repos(step: dict[str, str], capfd: pytest.CaptureFixture[str]) -> None:
    repos = [{"repo": "alice/a", "revision": "a" * 40, "loads": 6, "pull_request": "https://hub/alice/a/discussions/1",
              "changes": [{"component": "model", "path": "library", "versions": "transformers 5.25.0", "before": None,
                           "after": "fail"}]},
             {"repo": "alice/b", "revision": "b" * 40, "loads": 6, "pull_request": None, "changes": []}]
    env = {**step, "HFAO_MODEL": "", "HFAO_QUANT": "", "HFAO_RECHECK": "alice/a\nalice/b", "HFAO_VERIFY_MATRIX": "latest",
           "FAKE_RESULT": json.dumps({"repos": repos})}
    assert run(env) == 0
    outputs = parse_output_file(Path(step["GITHUB_OUTPUT"]))
    assert json.loads(outputs["result-json"])["argv"] == ["recheck", "alice/a", "alice/b", "--compat=latest", "--json"]
    assert outputs["repo-id"] == "alice/a\nalice/b" and outputs["pr-url"] == "https://hub/alice/a/discussions/1\n"
    assert outputs["verified"] == "true" and outputs["up-to-date"] == "false" and outputs["output-dir"] == ""
    summary = Path(step["GITHUB_STEP_SUMMARY"]).read_text()
    assert "| alice/a | model library (transformers 5.25.0): new, fail | [pull request](https://hub/alice/a/discussions/1) |" in summary
    assert "| alice/b | none |" in summary
    assert not any(p.name.startswith("hf-ao-publish-out-") for p in Path(step["RUNNER_TEMP"]).iterdir())  # no folder left
    failed = [{"repo": "alice/c", "error": "repo alice/c not found"}]
    assert run({**env, "HFAO_RECHECK": "alice/c", "FAKE_RESULT": json.dumps({"repos": failed})}) == 1
    assert "alice/c: repo alice/c not found" in [c.message for c in parse_commands(capfd.readouterr().out) if c.name == "error"]


def test_run_keeps_the_folder_without_push(step: dict[str, str]) -> None:
    assert run({**step, "HFAO_PUSH": "false", "FAKE_RESULT": json.dumps(sample_result(pushed=False))}) == 0
    outputs = parse_output_file(Path(step["GITHUB_OUTPUT"]))
    assert Path(outputs["output-dir"], "README.md").is_file()
    assert "--no-push" in json.loads(outputs["result-json"])["argv"]


def test_run_reports_the_cli_error(step: dict[str, str], capfd: pytest.CaptureFixture[str]) -> None:
    assert run({**step, "FAKE_MODE": "fail"}) == 1
    commands = parse_commands(capfd.readouterr().out)
    assert [c.message for c in commands if c.name == "error"] == ["boom for ***"]
    outputs = parse_output_file(Path(step["GITHUB_OUTPUT"]))
    assert outputs["verified"] == "false" and outputs["output-dir"] == ""  # the empty folder was removed
    assert json.loads(outputs["result-json"]) == {"error": "boom for ***", "exit_code": 1}
    assert "> **Error:** boom for ***" in Path(step["GITHUB_STEP_SUMMARY"]).read_text()


def test_run_bad_input_and_missing_cli(step: dict[str, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run({**step, "HFAO_PRIVATE": "maybe"}) == 2
    assert json.loads(parse_output_file(Path(step["GITHUB_OUTPUT"]))["result-json"])["exit_code"] == 2
    nowhere = {**step, "HFAO_PYTHON": str(tmp_path / "absent" / "python"), "PATH": str(tmp_path / "absent")}
    os.remove(step["GITHUB_OUTPUT"])
    assert run(nowhere) == 1
    errors = [c.message for c in parse_commands(capfd.readouterr().out) if c.name == "error"]
    assert errors[-1].startswith("cannot start ") and len(errors) == 2
    assert parse_output_file(Path(step["GITHUB_OUTPUT"]))["verified"] == "false"


def test_cli_command_and_failure_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli_command(str(tmp_path / "python"))[:2] == [str(tmp_path / "python"), "-c"]
    assert failure_message(CliRun(0, "{}", ["Error: late"])) == "late"
    assert failure_message(CliRun(0, "{}", ["fine"])) is None
    assert failure_message(CliRun(-9, "", ["Killed"])) == "hf-ao-publish exited with code -9: Killed"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_step_is_forwarded_once_to_the_cli(step: dict[str, str], tmp_path: Path, signum: int) -> None:
    """A cancelled workflow signals the step (here its whole process group): the CLI, in its own session, gets
    the signal once, from the glue, ends with its own message, and the step still writes the summary and outputs."""
    ready = tmp_path / "ready"
    env = {**step, "FAKE_MODE": "wait", "FAKE_READY": str(ready)}
    glue = subprocess.Popen([sys.executable, "-I", str(ROOT / "action" / "main.py"), "run"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert glue.poll() is None and time.monotonic() < deadline, glue.communicate()
        time.sleep(0.02)
    os.killpg(glue.pid, signum)
    out, err = glue.communicate(timeout=60)
    assert glue.returncode == 128 + signum, err
    sid, received = ready.read_text().split()
    assert int(sid) != glue.pid and received == str(int(signum))  # own session, exactly one signal
    name = "SIGINT" if signum == signal.SIGINT else "SIGTERM"
    assert [c.message for c in parse_commands(out) if c.name == "error"] == [f"interrupted by {name}: cleaned up"]
    outputs = parse_output_file(Path(step["GITHUB_OUTPUT"]))
    assert json.loads(outputs["result-json"])["exit_code"] == 128 + signum and outputs["verified"] == "false"
    assert f"interrupted by {name}" in Path(step["GITHUB_STEP_SUMMARY"]).read_text()
