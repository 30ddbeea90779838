"""Several models at once on the loopback Jobs service (publisher/hfjobs/many.py), through the real CLI.

Covered: three models x two recipes = six real jobs (the wheel of this checkout, pip-installed in each job), followed
together with `[model recipe]` prefixes and one table on stdout, then --attach of all six with --json (the list);
the one-preflight rule (a bad third model, or two models aimed at one repo: no job is submitted); Ctrl-C cancelling
every model's jobs; --attach of jobs of several models made by hand (cheap). The single-model runs are in
test_hfjobs_e2e.py.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX, seed
from huggingface_hub import HfApi
from jobs_harness import interrupted_while_following, result_in_log

from publisher.hfjobs.bootstrap import EXIT_MARKER, RESULT_MARKER
from publisher.hfjobs.many import COLUMNS

TOKEN = "tok_alice"


@pytest.fixture(scope="module")
def three_models(hub: Any, llama_repo: str, tiny_llama_dir: Path) -> list[str]:
    """meta/tiny-llama and two more repos of it under other names (so their default targets differ)."""
    for name in ("meta/tiny-llama-b", "meta/tiny-llama-c"):
        seed(name, tiny_llama_dir, "tok_meta")
    return [llama_repo, "meta/tiny-llama-b", "meta/tiny-llama-c"]


def _started(text: str) -> list[tuple[str, str, str]]:
    """(job id, model, recipe) of every job the command announced, in order."""
    return re.findall(r"^started job (\w+) for (\S+) (\S+) on ", text, re.MULTILINE)


def _rows(stdout: str) -> list[list[str]]:
    """The table's rows split on its column gaps (two spaces or more), header first."""
    return [re.split(r"\s{2,}", line.strip()) for line in stdout.strip().splitlines()]


@pytest.mark.slow
def test_three_models_two_recipes_are_six_jobs_and_one_table(cli: Any, hub: Any, three_models: list[str]) -> None:
    started = time.monotonic()
    result = cli(*three_models, "--quant", "int8wo,float8wo", "--on-hf-jobs", "cpu-basic", *IN_PROCESS,
                 *SKIP_EVAL_AND_MATRIX, "--repo-id", "alice/{model}-many-{recipe}", token=TOKEN)
    took = time.monotonic() - started
    assert result.exit_code == 0, result.output
    jobs = _started(result.stderr)
    assert [(m, r) for _, m, r in jobs] == [(m, r) for m in three_models for r in ("int8wo", "float8wo")]
    assert "following 6 job(s)" in result.stderr
    rows = _rows(result.stdout)
    assert tuple(rows[0]) == COLUMNS and len(rows) == 7  # one table: a header and a row per job, nothing else
    api = HfApi(token=TOKEN)
    for (job_id, model, recipe), row in zip(jobs, rows[1:]):
        repo = f"alice/{model.split('/')[-1]}-many-{recipe}"
        assert row[:4] == [model, recipe, repo, "yes"] and row[6] == f"{hub.url}/jobs/alice/{job_id}"
        assert re.fullmatch(r"\d+\.\d\d (KB|MB)", row[4]) and row[5] == "-"  # --eval-budget 0: no quality figure
        job = hub.jobs.get(job_id)
        assert job.stage == "COMPLETED" and job.spec["labels"]["recipe"] == recipe
        args = json.loads(job.spec["command"][-1])["args"]
        assert args[:2] == ["publish", model] and args[args.index("--repo-id") + 1] == repo
        assert api.model_info(repo).sha == result_in_log(hub, job_id)["commit"]  # type: ignore[index]
        assert f"[{model} {recipe}] " in result.stderr  # each log line prefixed with its model and recipe
    assert TOKEN not in result.output
    print(f"six loopback jobs (3 models x 2 recipes): {took:.0f} s\n{result.stdout}")

    again = cli(*[a for job_id, _, _ in jobs for a in ("--attach", job_id)], "--json", token=TOKEN)
    assert again.exit_code == 0, again.output
    listed = json.loads(again.stdout)
    assert isinstance(listed, list) and len(listed) == 6
    for (job_id, model, recipe), entry in zip(jobs, listed):
        assert (entry["model"], entry["recipe"], entry["job_id"]) == (model, recipe, job_id)
        own = {k: v for k, v in entry.items() if k not in ("model", "job_id", "job_url")}
        assert own == result_in_log(hub, job_id) and entry["verified"] and entry["error"] is None


def _job_count(hub: Any) -> int:
    return len(hub.jobs.jobs)


def test_one_preflight_a_bad_third_model_starts_no_job(cli: Any, hub: Any, three_models: list[str]) -> None:
    before = _job_count(hub)
    bad = cli(*three_models[:2], "meta/no-such-model", "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", "--json",
              token=TOKEN)
    assert bad.exit_code == 1, bad.output
    assert bad.stderr.splitlines()[-1].startswith("Error: repo meta/no-such-model not found on ")
    assert json.loads(bad.stdout)["exit_code"] == 1
    malformed = cli(three_models[0], "not a repo!", "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", token=TOKEN)
    assert malformed.exit_code == 2 and "MODEL_ID 'not a repo!' is neither an existing local folder nor a Hub repo id" in malformed.stderr
    one_repo = cli(*three_models[:2], "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", "--repo-id", "alice/same",
                   token=TOKEN)
    assert one_repo.exit_code == 2
    assert (f"{three_models[0]} int8wo and {three_models[1]} int8wo would both publish to alice/same; give each model "
            "its own --repo-id (with several models, put {model} in it") in one_repo.stderr
    twice = cli(three_models[0], three_models[0], "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", token=TOKEN)
    assert twice.exit_code == 2 and f"{three_models[0]} is given more than once" in twice.stderr
    assert _job_count(hub) == before  # nothing was submitted, nothing billed


def _handmade(api: HfApi, model: str, recipe: str, seconds: float = 0) -> Any:
    """A job that looks like one this tool started for ``model``: its labels, its spec's command line, and a result
    printed with bootstrap.py's markers (after ``seconds``)."""
    done = {"recipe": recipe, "repo_id": f"alice/{model.split('/')[-1]}-{recipe}", "url": "http://hub/x", "commit": "c" * 40,
            "pr_url": None, "verified": True, "pushed": True, "up_to_date": False, "error": None,
            "files": [{"name": "model.safetensors", "size": 2_500_000}],
            "evaluation": {"kind": "causal language model", "recovery_percent": 99.25}}
    encoded = base64.b64encode(json.dumps(done).encode()).decode()
    code = (f"import time\ntime.sleep({seconds})\nprint('working on {model}', flush=True)\n"
            f"print('{RESULT_MARKER} 1/1 {encoded}')\nprint('{EXIT_MARKER} 0')")
    spec = json.dumps({"args": ["publish", model, "--quant", recipe, "--repo-id", done["repo_id"], "--json"]})
    return api.run_job(image="python:3.11", command=["python", "-c", code, spec], flavor="cpu-basic", namespace="alice",
                       labels={"tool": "hf-ao-publish", "recipe": recipe})


def test_attach_follows_jobs_of_several_models(cli: Any, hub: Any) -> None:
    api = HfApi(token=TOKEN)
    jobs = [_handmade(api, "org/first", "int8wo"), _handmade(api, "org/second", "int8wo"),
            _handmade(api, "org/second", "float8wo")]
    attach = [a for job in jobs for a in ("--attach", job.id)]
    result = cli(*attach, token=TOKEN)
    assert result.exit_code == 0, result.output
    assert _rows(result.stdout) == [list(COLUMNS)] + [
        [model, recipe, f"alice/{model.split('/')[1]}-{recipe}", "yes", "2.50 MB", "ppl recovery 99.2%", job.url]
        for job, (model, recipe) in zip(jobs, [("org/first", "int8wo"), ("org/second", "int8wo"),
                                               ("org/second", "float8wo")])]
    assert "[org/first int8wo] working on org/first" in result.stderr
    assert "[org/second float8wo] working on org/second" in result.stderr
    listed = json.loads(cli(*attach, "--json", token=TOKEN).stdout)
    assert [(e["model"], e["recipe"], e["job_id"], e["job_url"]) for e in listed] == [
        ("org/first", "int8wo", jobs[0].id, jobs[0].url), ("org/second", "int8wo", jobs[1].id, jobs[1].url),
        ("org/second", "float8wo", jobs[2].id, jobs[2].url)]
    # jobs of one model are reported as the single-model command reports them: no model named, no table
    single = cli("--attach", jobs[1].id, "--attach", jobs[2].id, token=TOKEN)
    assert single.exit_code == 0 and single.stdout == "http://hub/x\nhttp://hub/x\n"
    assert "[int8wo] working on org/second" in single.stderr


def test_a_failed_job_of_several_models_is_a_row_and_the_list_says_it(cli: Any, hub: Any) -> None:
    api = HfApi(token=TOKEN)
    good = _handmade(api, "org/first", "int8wo")
    failing = api.run_job(image="python:3.11", command=["python", "-c", "import sys\nprint('Error: boom')\nsys.exit(1)",
                                                        json.dumps({"args": ["publish", "org/second", "--quant", "int8wo",
                                                                             "--repo-id", "alice/second-int8wo"]})],
                          flavor="cpu-basic", namespace="alice", labels={"tool": "hf-ao-publish", "recipe": "int8wo"})
    attach = ["--attach", good.id, "--attach", failing.id, "--keep-going"]
    result = cli(*attach, token=TOKEN)
    assert result.exit_code == 1
    assert _rows(result.stdout)[2][:4] == ["org/second", "int8wo", "alice/second-int8wo", "FAILED"]
    assert f"job {failing.id} (org/second int8wo on cpu-basic) failed with exit code 1: boom" in result.stderr
    assert result.stderr.splitlines()[-1] == "Error: 1 of 2 jobs failed"
    listed = json.loads(cli(*attach, "--json", token=TOKEN).stdout)
    assert listed[0]["error"] is None and listed[1]["error"].startswith(f"job {failing.id} (org/second int8wo")


@pytest.mark.slow
def test_ctrl_c_cancels_the_jobs_of_every_model(hub: Any, three_models: list[str]) -> None:
    hub.jobs.scheduling_s = 300.0  # the jobs wait for their hardware, as on the real service
    try:
        seen, rest, code = interrupted_while_following(
            [*three_models, "--quant", "int8wo", "--on-hf-jobs", "cpu-basic", "--repo-id", "alice/{model}-ctrl-c-{recipe}"],
            TOKEN, jobs=3, wait_s=90)
    finally:
        hub.jobs.scheduling_s = 0.0
    assert code == 130
    ids = [job_id for job_id, _, _ in _started(seen)]
    for job_id, model in zip(ids, three_models):
        assert f"Ctrl-C: cancelled job {job_id} ({model} int8wo on cpu-basic)" in rest
        assert hub.jobs.get(job_id).stage == "CANCELED" and hub.jobs.get(job_id).proc is None
    assert rest.splitlines()[-1] == f"Error: interrupted (Ctrl-C): cancelled the running jobs on the Hub ({', '.join(ids)})"
