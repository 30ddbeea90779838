"""Hugging Face Jobs on the loopback Hub: the endpoints huggingface_hub 2.4 calls, with jobs run as local processes.

    POST /api/jobs/{ns}                 run_job / run_uv_job      -> the job (stage SCHEDULING)
    GET  /api/jobs/{ns}[?label=k=v&stage=S]   list_jobs
    GET  /api/jobs/{ns}/{id}            inspect_job, wait_for_job, and fetch_job_logs' end-of-stream check
    GET  /api/jobs/{ns}/{id}/logs       fetch_job_logs: server-sent events `data: {"data", "timestamp"}`, replayed
                                        from the start on every request, kept open while the job runs
    POST /api/jobs/{ns}/{id}/cancel     cancel_job
    GET  /api/jobs/hardware             list_jobs_hardware (the flavors of publisher/flavors.py; test prices)

A job runs its `command` as a local process, in a new session (so cancel and timeout end the whole group), with
exactly its `environment` and `secrets` and a minimal PATH/HOME, never the server's own environment. The
"image" is a fresh virtual environment layered on the server's interpreter (`job_python`): its packages are
visible (so nothing heavy is downloaded) but what the job pip-installs goes into the job's own environment.
Stages follow the real service: SCHEDULING (for `scheduling_s`), RUNNING (the log starts with
"===== Job started at ... =====", which the client hides), then COMPLETED, ERROR ("Job failed with exit code:
N", or a timeout) or CANCELED. The process environment of each job is kept in memory for tests to inspect.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from publisher import flavors as flavor_table
from publisher.testing.hubserver.access import HubAccess
from publisher.testing.hubserver.storage import HubError
from publisher.testing.hubserver.wire import Request, Response, json_response

TERMINAL = ("COMPLETED", "CANCELED", "ERROR", "DELETED")
KEEPALIVE_S = 1.0


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f") + "Z"


@dataclass
class LoopbackJob:
    id: str
    owner: str
    spec: dict[str, Any]
    folder: Path
    created_at: str = field(default_factory=_now)
    stage: str = "SCHEDULING"
    message: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    log: list[tuple[str, str]] = field(default_factory=list)  # (timestamp, line)
    process_env: dict[str, str] = field(default_factory=dict)  # what the process was started with (tests)
    proc: subprocess.Popen | None = None
    cancel_requested: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def add_line(self, line: str) -> None:
        with self.cond:
            self.log.append((_now(), line))
            self.cond.notify_all()

    def finish(self, stage: str, message: str | None = None) -> None:
        with self.cond:
            if self.stage in TERMINAL:
                return
            self.stage, self.message, self.finished_at = stage, message, _now()
            self.cond.notify_all()

    def to_json(self) -> dict[str, Any]:
        spec = self.spec
        out: dict[str, Any] = {
            "id": self.id, "createdAt": self.created_at, "startedAt": self.started_at, "finishedAt": self.finished_at,
            "dockerImage": spec.get("dockerImage"), "spaceId": spec.get("spaceId"), "command": spec.get("command"),
            "arguments": spec.get("arguments", []), "environment": spec.get("environment", {}),
            # like the Hub: the names of the secrets, never their values
            "secrets": {name: None for name in spec.get("secrets") or {}},
            "flavor": spec.get("flavor"), "labels": spec.get("labels"), "timeoutSeconds": spec.get("timeoutSeconds"),
            "status": {"stage": self.stage, "message": self.message},
            "owner": {"id": self.owner, "name": self.owner, "type": "user"},
            "initiator": {"type": "user", "id": self.owner, "name": self.owner},
        }
        return out


def hardware_json() -> list[dict[str, Any]]:
    """The built-in flavor table in the Hub's format. The prices are test data (rising in table order), not
    the Hub's: real prices are the user's account's (`hf jobs hardware`)."""
    out = []
    for i, flavor in enumerate(flavor_table.BUILTIN):
        micro = 100 * (i + 1)
        accelerator = None
        if flavor.gpu:
            accelerator = {"type": "gpu", "model": flavor.gpu, "quantity": str(flavor.gpus), "vram": flavor.vram,
                           "manufacturer": "Nvidia"}
        out.append({"name": flavor.name, "prettyName": flavor.name, "cpu": "2 vCPU", "ram": "16 GB",
                    "ephemeralStorage": "50 GB", "accelerator": accelerator, "unitCostMicroUSD": micro,
                    "unitCostUSD": micro / 1e6, "unitLabel": "minute"})
    return out


class JobRunner:
    """The jobs of one loopback Hub and the processes that run them."""

    def __init__(self, folder: Path, job_python: str | None = None, scheduling_s: float = 0.0) -> None:
        self.folder = folder
        self.job_python = job_python or sys.executable
        self.scheduling_s = scheduling_s
        self.jobs: dict[str, LoopbackJob] = {}
        self.lock = threading.Lock()
        # job id -> N: the next log stream of that job breaks off after N lines (a dropped connection), and the
        # request that follows it is answered 503 (a flaky proxy); once
        self.cut_logs: dict[str, int] = {}
        self.refuse_logs: set[str] = set()

    def create(self, owner: str, spec: dict[str, Any]) -> LoopbackJob:
        job_id = uuid.uuid4().hex[:24]
        job = LoopbackJob(job_id, owner, spec, self.folder / job_id)
        with self.lock:
            self.jobs[job_id] = job
        threading.Thread(target=self._run, args=(job,), name=f"loopback-job-{job_id}", daemon=True).start()
        return job

    def get(self, job_id: str) -> LoopbackJob | None:
        return self.jobs.get(job_id)

    # ---- running ---------------------------------------------------------------------------------
    def _image(self, job: LoopbackJob) -> Path:
        """A venv whose site-packages also sees the server interpreter's packages (a .pth line)."""
        venv = job.folder / "image"
        subprocess.run([self.job_python, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
        where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        parent = subprocess.run([self.job_python, "-c", where], check=True, capture_output=True, text=True).stdout.strip()
        purelib = Path(subprocess.run([str(venv / "bin" / "python"), "-I", "-c", where], check=True, capture_output=True,
                                      text=True).stdout.strip())
        purelib.mkdir(parents=True, exist_ok=True)
        (purelib / "_loopback_image.pth").write_text(parent + "\n")
        return venv

    def _run(self, job: LoopbackJob) -> None:
        deadline = time.monotonic() + self.scheduling_s
        while time.monotonic() < deadline and not job.cancel_requested:
            time.sleep(0.05)
        with job.cond:
            if job.cancel_requested:
                job.finish("CANCELED")
                return
            job.stage, job.started_at = "RUNNING", _now()
        try:
            job.folder.mkdir(parents=True, exist_ok=True)
            venv = self._image(job)
            home, tmp = job.folder / "home", job.folder / "tmp"
            home.mkdir(exist_ok=True)
            tmp.mkdir(exist_ok=True)
            env = {"PATH": f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(home), "TMPDIR": str(tmp),
                   "LANG": "C.UTF-8", "JOB_ID": job.id}
            env.update({k: str(v) for k, v in (job.spec.get("environment") or {}).items()})
            env.update({k: str(v) for k, v in (job.spec.get("secrets") or {}).items()})
            job.process_env = env
            job.add_line(f"===== Job started at {job.started_at} =====")
            command = list(job.spec.get("command") or []) + list(job.spec.get("arguments") or [])
            executable = str(venv / "bin" / command[0]) if (venv / "bin" / command[0]).exists() else command[0]
            with job.cond:
                if job.cancel_requested:
                    job.finish("CANCELED")
                    return
                job.proc = subprocess.Popen([executable, *command[1:]], cwd=home, env=env, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace",
                                            start_new_session=True)
        except (OSError, subprocess.CalledProcessError, IndexError) as exc:
            job.add_line(f"failed to start the job: {exc}")
            job.finish("ERROR", f"Failed to start: {exc}")
            return
        timeout = job.spec.get("timeoutSeconds")
        if timeout:
            threading.Timer(float(timeout), self._expire, args=(job,)).start()
        assert job.proc.stdout is not None
        for line in job.proc.stdout:
            job.add_line(line.rstrip("\n"))
        code = job.proc.wait()
        if job.cancel_requested:
            job.finish("CANCELED")
        elif code == 0:
            job.finish("COMPLETED")
        else:
            job.finish("ERROR", f"Job failed with exit code: {code}")

    def _kill(self, job: LoopbackJob) -> None:
        proc = job.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _expire(self, job: LoopbackJob) -> None:
        if job.stage not in TERMINAL:
            job.finish("ERROR", "Job timeout exceeded")
            self._kill(job)

    def cancel(self, job: LoopbackJob) -> None:
        with job.cond:
            job.cancel_requested = True
        self._kill(job)
        if job.proc is None or job.proc.poll() is not None:
            job.finish("CANCELED")

    def stop_all(self) -> None:
        for job in list(self.jobs.values()):
            if job.stage not in TERMINAL:
                self.cancel(job)

    def stream(self, job: LoopbackJob, tail: int | None) -> Iterator[bytes]:
        """The log as server-sent events: everything so far, then each new line, until the job has ended."""
        index = max(0, len(job.log) - tail) if tail is not None else 0
        cut, sent = self.cut_logs.pop(job.id, None), 0
        while True:
            with job.cond:
                if index >= len(job.log) and job.stage not in TERMINAL:
                    job.cond.wait(KEEPALIVE_S)
                new, ended = job.log[index:], job.stage in TERMINAL
            index += len(new)
            for ts, line in new:
                if cut is not None and sent >= cut:  # the transport hangs up without ending the chunked body
                    self.refuse_logs.add(job.id)
                    raise ConnectionError(f"log stream of job {job.id} cut after {cut} lines (test control)")
                sent += 1
                yield b"data: " + json.dumps({"data": line, "timestamp": ts}).encode() + b"\n\n"
            if not new and not ended:
                yield b": keep-alive\n\n"
            if ended and index >= len(job.log):
                return


class JobRoutes(HubAccess):
    """The /api/jobs endpoints (mixed into HubApp)."""

    runner: JobRunner

    def route_jobs(self, req: Request, parts: list[str]) -> Response:
        m, n = req.method, len(parts)
        if parts == ["hardware"] and m == "GET":
            return json_response(hardware_json())
        if req.user is None:
            raise HubError(401, "You must be authenticated to use Jobs (no token sent)")
        if n == 0:
            raise HubError(404, "Unknown API route /api/jobs")
        namespace = parts[0]
        if not self.is_member(req.user, namespace):
            raise HubError(403, f"You don't have the rights to run jobs in '{namespace}'")
        self.require_permission(req, "job.write", namespace)
        if n == 1 and m == "POST":
            return self.create_job(req, namespace)
        if n == 1 and m == "GET":
            return self.list_jobs(req, namespace)
        job = self.runner.get(parts[1])
        if job is None or job.owner != namespace:
            raise HubError(404, f"Job {parts[1]} not found")
        if n == 2 and m == "GET":
            return json_response(job.to_json())
        if n == 3 and parts[2] == "logs" and m == "GET":
            if job.id in self.runner.refuse_logs:
                self.runner.refuse_logs.discard(job.id)
                raise HubError(503, "Service temporarily unavailable (loopback test control)")
            tail = req.q("tail")
            return Response(200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
                            stream=self.runner.stream(job, int(tail) if tail and tail.isdigit() else None))
        if n == 3 and parts[2] == "cancel" and m == "POST":
            self.runner.cancel(job)
            return json_response({})
        raise HubError(404, f"Unknown API route {m} /api/jobs/{'/'.join(parts)}")

    def create_job(self, req: Request, namespace: str) -> Response:
        spec = req.json()
        if not isinstance(spec, dict) or not spec.get("command") or not (spec.get("dockerImage") or spec.get("spaceId")):
            raise HubError(400, "A job needs a command and a dockerImage (or spaceId)")
        if flavor_table.find(str(spec.get("flavor")), flavor_table.BUILTIN) is None:
            raise HubError(400, f"Invalid flavor {spec.get('flavor')!r}")
        for key, value in (spec.get("labels") or {}).items():
            if not all(str(s).replace("-", "").replace("_", "").isalnum() and len(str(s)) <= 100 for s in (key, value)):
                raise HubError(400, f"Invalid label {key}={value}: alphanumerics, '-' and '_' only, 100 characters at most")
        return json_response(self.runner.create(namespace, spec).to_json())

    def list_jobs(self, req: Request, namespace: str) -> Response:
        labels = [v.split("=", 1) for v in req.query.get("label", []) if "=" in v]
        stages = set(req.query.get("stage", []))
        found = [j.to_json() for j in self.runner.jobs.values() if j.owner == namespace
                 and all((j.spec.get("labels") or {}).get(k) == v for k, v in labels)
                 and (not stages or j.stage in stages)]
        return json_response(found)
