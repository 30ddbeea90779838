"""`--on-hf-jobs` end to end on the loopback Hub: the jobs are local processes that download the wheel of this
checkout, pip-install it into their own environment and run its CLI against the same loopback Hub.

Covered: the tiny FLUX pipeline published by two parallel jobs, with the --json result read back from the
jobs' logs; the token only ever a job secret; reattaching (--attach) through a dropped log stream; a job that
fails (its exit code and last line become our one-line error); Ctrl-C cancelling a submitted job; the Action
with run-on: hf-jobs through the runner harness. The refusals that need no job are in test_hfjobs.py.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from action_harness import assert_secret_absent, run_action
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX
from huggingface_hub import HfApi
from jobs_harness import interrupted_while_following, result_in_log

from publisher.hfjobs.bootstrap import EXIT_MARKER, RESULT_MARKER

SMALL = ["--sample-steps", "2", "--sample-size", "64"]
TOKEN = "tok_alice"


def _started(text: str) -> list[str]:
    """The job ids the command announced, in order."""
    return re.findall(r"^started job (\w+) for ", text, re.MULTILINE)


def _assert_token_only_a_secret(hub: Any, job_id: str, token: str) -> None:
    job = hub.jobs.get(job_id)
    spec = dict(job.spec)
    assert spec.pop("secrets") == {"HF_TOKEN": token}
    assert token not in json.dumps(spec)  # not in the command, the environment, the labels
    assert token not in "\n".join(line for _, line in job.log)
    assert job.process_env["HF_TOKEN"] == token  # it reached the job as the secret, and only so
    info = HfApi(token=token).inspect_job(job_id=job_id, namespace="alice")
    assert token not in json.dumps({"env": info.environment, "cmd": info.command, "secrets": info.secrets})


@pytest.mark.transfer
@pytest.mark.slow
def test_publish_tiny_flux_on_two_parallel_jobs_and_attach_again(cli: Any, hub: Any, flux_repo: str) -> None:
    started = time.monotonic()
    # the jobs verify in process (the option reaches the jobs' command line): the subject is the jobs, not the load
    # paths; the default mode's fresh-interpreter reloads are covered end to end by test_action.py's publish.
    # A target of its own: another test file on this worker's loopback Hub may have published the default names.
    result = cli(flux_repo, "--quant", "int8wo,float8wo", "--on-hf-jobs", "cpu-basic", "--json", *SMALL,
                 *IN_PROCESS, *SKIP_EVAL_AND_MATRIX, "--repo-id", "alice/tiny-flux-two-jobs-{recipe}", token=TOKEN)
    took = time.monotonic() - started
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["recipe"] for r in data["results"]] == ["int8wo", "float8wo"] and data["verified"] is True
    ids = _started(result.stderr)
    assert len(ids) == 2
    api = HfApi(token=TOKEN)
    for job_id, entry in zip(ids, data["results"]):
        assert entry["repo_id"] == f"alice/tiny-flux-two-jobs-{entry['recipe']}"
        job = hub.jobs.get(job_id)
        assert job.stage == "COMPLETED"
        assert f"started job {job_id} for {entry['recipe']} on cpu-basic: {hub.url}/jobs/alice/{job_id}" in result.stderr
        assert result_in_log(hub, job_id) == entry  # the result printed here is the one the job computed
        assert job.spec["dockerImage"] == "python:3.11" and job.spec["flavor"] == "cpu-basic"
        assert job.spec["timeoutSeconds"] == 7200 and job.spec["labels"]["recipe"] == entry["recipe"]
        args = json.loads(job.spec["command"][-1])["args"]
        assert args[:3] == ["publish", flux_repo, "--quant"] and "--json" in args and "--revision" in args
        assert args[args.index("--verify-mode") + 1] == "streaming"
        assert args[args.index("--eval-budget") + 1] == "0" and args[args.index("--compat") + 1] == "none"
        assert entry["pushed"] and entry["verified"] and api.model_info(entry["repo_id"]).sha == entry["commit"]
        assert "verification.json" in api.list_repo_files(entry["repo_id"])
        _assert_token_only_a_secret(hub, job_id, TOKEN)
    # the two logs streamed here, each line prefixed with its recipe
    assert "[int8wo] hf-ao-publish job: downloading hf_ao_publish-" in result.stderr
    assert "[float8wo] quantizing transformer (FluxTransformer2DModel) with float8wo" in result.stderr
    assert TOKEN not in result.output
    print(f"two parallel loopback jobs: {took:.0f} s")

    # Reattach: the first stream breaks off after 5 lines, huggingface_hub's retry of it is refused with a 503, so
    # we follow the log again and skip what was shown: every line is shown once, and the result is the same.
    hub.jobs.cut_logs[ids[0]] = 5
    again = cli("--attach", ids[0], "--attach", ids[1], "--json", token=TOKEN)
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout) == data
    assert f"job {ids[0]} (int8wo on cpu-basic): reading its log failed (HTTP 503" in again.stderr
    shown = [line for line in again.stderr.splitlines() if line.startswith("[int8wo] ")]
    expected = [f"[int8wo] {line}" for _, line in hub.jobs.get(ids[0]).log
                if line.strip() and not line.startswith(("##[hf-ao-publish:", "===== Job started"))]
    assert [line for line in shown if line.strip() != "[int8wo]"] == expected


@pytest.mark.slow
def test_a_failing_job_is_one_error_line(cli: Any, hub: Any, flux_repo: str) -> None:
    # The job's first step fails: the wheel download is refused (the job exits 1 without a result).
    hub.set_fault(status=404, match="/hf-ao-publish-jobs/resolve/", count=1)
    result = cli(flux_repo, "--quant", "int8dq", "--on-hf-jobs", "cpu-basic", "--repo-id", "alice/failing-{recipe}",
                 "--json", token=TOKEN)
    assert result.exit_code == 1, result.output
    (job_id,) = _started(result.stderr)
    last = result.stderr.splitlines()[-1]
    assert re.fullmatch(rf"Error: job {job_id} \(int8dq on cpu-basic\) failed with exit code 1: hf-ao-publish job: "
                        rf"cannot download the tool's wheel: HTTP 404 for \S+ \(full log: \S+/jobs/alice/{job_id}\)", last)
    assert json.loads(result.stdout)["error"] == last.removeprefix("Error: ")  # --json still says what happened
    assert not HfApi(token=TOKEN).repo_exists("alice/failing-int8dq")


def test_attach_reports_the_cli_error_of_a_failed_job(cli: Any, hub: Any) -> None:
    # A job whose CLI failed: its "Error: ..." line and exit code 2 become our one-line error.
    code = (f"import sys\nprint('quantizing transformer', flush=True)\n"
            f"print('Error: the base repo bfl/gone was deleted', file=sys.stderr, flush=True)\n"
            f"print('{EXIT_MARKER} 2', flush=True)\nsys.exit(2)")
    job = HfApi(token=TOKEN).run_job(image="python:3.11", command=["python", "-c", code], flavor="cpu-basic",
                                     labels={"tool": "hf-ao-publish", "recipe": "int8wo"}, namespace="alice")
    result = cli("--attach", job.id, token=TOKEN)
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (f"Error: job {job.id} (int8wo on cpu-basic) failed with exit code 2: the "
                                              f"base repo bfl/gone was deleted (full log: {job.url})")
    assert "quantizing transformer" in result.stderr
    other = HfApi(token=TOKEN).run_job(image="python:3.11", command=["python", "-c", "print(1)"], namespace="alice")
    refused = cli("--attach", other.id, token=TOKEN)
    assert refused.exit_code == 2 and "was not started by hf-ao-publish --on-hf-jobs" in refused.stderr


@pytest.mark.slow
def test_ctrl_c_cancels_the_submitted_job(hub: Any, flux_repo: str) -> None:
    hub.jobs.scheduling_s = 300.0  # the job waits for its hardware, as on the real service

    def scheduling(seen: str) -> None:
        (started,) = _started(seen)
        assert hub.jobs.get(started).stage == "SCHEDULING"

    try:
        seen, rest, code = interrupted_while_following(
            [flux_repo, "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", "--repo-id", "alice/ctrl-c-{recipe}"], TOKEN,
            jobs=1, wait_s=60, before=scheduling)
    finally:
        hub.jobs.scheduling_s = 0.0
    assert code == 130
    (job_id,) = _started(seen)
    assert f"Ctrl-C: cancelled job {job_id} (int8wo on cpu-basic)" in rest
    assert rest.splitlines()[-1] == f"Error: interrupted (Ctrl-C): cancelled the running jobs on the Hub ({job_id})"
    assert hub.jobs.get(job_id).stage == "CANCELED" and hub.jobs.get(job_id).proc is None


@pytest.mark.slow
def test_the_action_runs_on_hf_jobs(hub: Any, flux_repo: str, tmp_path: Path) -> None:
    run = run_action({"model": flux_repo, "quant": "int8wo", "repo-id": "alice/tiny-flux-action-jobs", "hf-token": TOKEN,
                      "run-on": "hf-jobs", "hf-jobs-flavor": "cpu-basic", "verify-matrix": "none",
                      "extra-args": " ".join([*SMALL, *IN_PROCESS, "--eval-budget", "0"])}, tmp_path)
    assert run.returncode == 0, run.log[-4000:]
    assert run.outputs["verified"] == "true" and run.outputs["repo-id"] == "alice/tiny-flux-action-jobs"
    result = json.loads(run.outputs["result-json"])
    (job_id,) = _started(run.log)
    assert result == result_in_log(hub, job_id) and result["commit"] == run.outputs["commit-sha"]
    assert run.outputs["output-dir"] == ""  # nothing was made on the runner
    args = json.loads(hub.jobs.get(job_id).spec["command"][-1])["args"]
    assert "--output-dir" not in args and args[args.index("--verify-mode") + 1] == "streaming"  # extra-args reach the job
    assert args[args.index("--eval-budget") + 1] == "0" and args[args.index("--compat") + 1] == "none"  # verify-matrix too
    assert_secret_absent(run, TOKEN)
    _assert_token_only_a_secret(hub, job_id, TOKEN)


def test_a_failed_job_stops_the_others_unless_keep_going(cli: Any, hub: Any) -> None:
    api = HfApi(token=TOKEN)

    def job(recipe: str, code: str) -> Any:
        return api.run_job(image="python:3.11", command=["python", "-c", code], flavor="cpu-basic", namespace="alice",
                           labels={"tool": "hf-ao-publish", "recipe": recipe})

    failing = "import sys\nprint('Error: boom', flush=True)\nsys.exit(1)"
    done = {"recipe": "int8wo", "repo_id": "alice/x", "url": "http://hub/alice/x", "commit": "c" * 40, "pr_url": None,
            "verified": True, "pushed": True, "up_to_date": False, "error": None}
    encoded = base64.b64encode(json.dumps(done).encode()).decode()
    slow = f"import time\ntime.sleep({{}})\nprint('{RESULT_MARKER} 1/1 {encoded}')\nprint('{EXIT_MARKER} 0')"
    first, second = job("int8dq", failing), job("int8wo", slow.format(120))
    result = cli("--attach", first.id, "--attach", second.id, token=TOKEN)
    assert result.exit_code == 1
    assert "int8dq failed, stopping the other jobs (--keep-going lets them finish): cancelled job" in result.stderr
    assert hub.jobs.get(second.id).stage == "CANCELED"
    assert result.stderr.splitlines()[-1].startswith(f"Error: job {first.id} (int8dq on cpu-basic) failed with exit code 1: boom")

    first, second = job("int8dq", failing), job("int8wo", slow.format(2))
    result = cli("--attach", first.id, "--attach", second.id, "--keep-going", token=TOKEN)
    assert result.exit_code == 1 and hub.jobs.get(second.id).stage == "COMPLETED"
    assert f"int8dq: FAILED: job {first.id} (int8dq on cpu-basic) failed with exit code 1: boom" in result.stderr
    assert result.stderr.splitlines()[-1] == "Error: 1 of 2 recipes failed"
    assert "published alice/x: http://hub/alice/x" in result.stderr
