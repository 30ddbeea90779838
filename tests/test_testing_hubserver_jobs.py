"""The loopback Hub's Jobs endpoints (publisher/testing/hubserver/jobs.py), driven by the unmodified
huggingface_hub client: create, inspect, logs as a stream, cancel, list, hardware; a job is a local process
with exactly its environment and secrets, and reports the stages the real service reports.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

pytestmark = pytest.mark.slow  # a self-test of the test infrastructure, as test_testing_hubserver.py

PY = "python"  # resolved in the job's own environment, as in a container


def _api() -> HfApi:
    return HfApi(token="tok_alice")


def _job(api: HfApi, code: str, **kw: Any) -> Any:
    kw.setdefault("flavor", "cpu-basic")
    return api.run_job(image="python:3.11", command=[PY, "-c", code], namespace="alice", **kw)


def test_a_job_runs_with_its_env_and_secrets_only(hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HUBSERVER_PRIVATE", "server-only")  # the server's environment must not leak into jobs
    api = _api()
    code = ("import os, sys\nprint('hello', flush=True)\nprint(os.environ.get('GREETING'), os.environ.get('HF_TOKEN'),"
            " os.environ.get('HUBSERVER_PRIVATE'), flush=True)\nprint('to stderr', file=sys.stderr)")
    job = _job(api, code, env={"GREETING": "hi"}, secrets={"HF_TOKEN": "tok_secret"}, labels={"tool": "t1"})
    assert job.status.stage in ("SCHEDULING", "RUNNING") and job.url.endswith(f"/jobs/alice/{job.id}")
    lines = list(api.fetch_job_logs(job_id=job.id, namespace="alice", follow=True))
    assert lines == ["hello", "hi tok_secret None", "to stderr"]  # "===== Job started" is hidden by the client
    info = api.inspect_job(job_id=job.id, namespace="alice")
    assert info.status.stage == "COMPLETED" and info.status.message is None
    assert info.environment == {"GREETING": "hi"} and info.secrets == {"HF_TOKEN": None}  # names, never values
    assert info.labels == {"tool": "t1", "name": info.labels["name"]} and info.owner.name == "alice"
    assert info.started_at is not None and info.finished_at is not None
    assert hub.jobs.get(job.id).process_env["HF_TOKEN"] == "tok_secret"
    assert [j.id for j in api.list_jobs(labels={"tool": "t1"}, namespace="alice")] == [job.id]
    assert list(api.fetch_job_logs(job_id=job.id, namespace="alice", tail=1)) == ["to stderr"]


def test_a_failing_job_reports_its_exit_code(hub: Any) -> None:
    api = _api()
    job = _job(api, "import sys\nprint('Error: boom', flush=True)\nsys.exit(3)")
    info = api.wait_for_job(job.id, namespace="alice", poll_interval=0.1, timeout=60)
    assert info.status.stage == "ERROR" and info.status.message == "Job failed with exit code: 3"
    assert list(api.fetch_job_logs(job_id=job.id, namespace="alice")) == ["Error: boom"]


def test_cancel_stops_the_process(hub: Any) -> None:
    api = _api()
    job = _job(api, "import time\nprint('started', flush=True)\ntime.sleep(120)")
    logs = api.fetch_job_logs(job_id=job.id, namespace="alice", follow=True)
    assert next(iter(logs)) == "started"
    api.cancel_job(job_id=job.id, namespace="alice")
    info = api.wait_for_job(job.id, namespace="alice", poll_interval=0.1, timeout=30)
    assert info.status.stage == "CANCELED"
    proc = hub.jobs.get(job.id).proc
    assert proc is not None and proc.poll() is not None


def test_cancel_while_scheduling_never_starts_it(hub: Any) -> None:
    api = _api()
    hub.jobs.scheduling_s = 30.0
    try:
        job = _job(api, "print('never')")
        assert api.inspect_job(job_id=job.id, namespace="alice").status.stage == "SCHEDULING"
        api.cancel_job(job_id=job.id, namespace="alice")
        assert api.wait_for_job(job.id, namespace="alice", poll_interval=0.1, timeout=10).status.stage == "CANCELED"
        assert hub.jobs.get(job.id).proc is None
    finally:
        hub.jobs.scheduling_s = 0.0


def test_timeout_ends_a_job(hub: Any) -> None:
    api = _api()
    job = _job(api, "import time\ntime.sleep(60)", timeout=1)
    started = time.monotonic()
    info = api.wait_for_job(job.id, namespace="alice", poll_interval=0.1, timeout=30)
    assert info.status.stage == "ERROR" and "timeout" in (info.status.message or "").lower()
    assert time.monotonic() - started < 15


def test_hardware_and_refusals(hub: Any) -> None:
    api = _api()
    hardware = {h.name: h for h in api.list_jobs_hardware()}
    assert hardware["l4x1"].accelerator is not None and hardware["l4x1"].accelerator.model == "L4"
    assert hardware["cpu-basic"].accelerator is None
    with pytest.raises(HfHubHTTPError) as bad_flavor:
        _job(api, "print(1)", flavor="h100-huge")
    assert bad_flavor.value.response.status_code == 400
    with pytest.raises(HfHubHTTPError) as other_namespace:
        api.run_job(image="python:3.11", command=[PY, "-c", "print(1)"], namespace="bob")
    assert other_namespace.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as anonymous:
        HfApi(token=False).inspect_job(job_id="x", namespace="alice", token=False)
    assert anonymous.value.response.status_code == 401
