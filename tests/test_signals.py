"""SIGTERM and SIGINT end a run cleanly at any stage (publisher/runtime/signals.py, procs.py, stages/unfinished.py).

Each test starts the real CLI as a subprocess against the loopback Hub, with TMPDIR and HF_HOME pointed at its own
folders, holds it in one stage (a worker process that is running, or the loopback Hub delaying an answer), sends the
signal, and checks: the exit code (130 / 143), the one line saying what was left and how to resume, no temporary
folder left, no worker process left (by pid and process group), no repo left that the run created.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import IN_PROCESS, SKIP_EVAL_AND_MATRIX, ended, seed

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub(hub: Any) -> Any:
    """The session's loopback Hub, without faults before and after the test."""
    hub.clear_faults()
    yield hub
    hub.clear_faults()


def test_handled_turns_both_signals_into_interrupted_and_restores_the_handlers() -> None:
    from publisher.errors import Interrupted
    from publisher.messages import describe
    from publisher.runtime.signals import handled

    before = signal.getsignal(signal.SIGTERM)
    for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        with pytest.raises(Interrupted) as stopped, handled():
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises here, in the main thread
        assert stopped.value.signum == signum and stopped.value.exit_code == code
        assert isinstance(stopped.value, KeyboardInterrupt) and not isinstance(stopped.value, Exception)
    assert signal.getsignal(signal.SIGTERM) == before
    stopped.value.left = ["the quantized model in the resume cache (/c)"]
    message, code = describe(stopped.value) or ("", 0)
    assert code == 130 and message.startswith("interrupted by SIGINT: ")
    assert message.endswith("left: the quantized model in the resume cache (/c); re-run the same command to resume")
    stopped.value.left = []  # nothing kept (a local base, no component finished): no promise of a resume
    message, _ = describe(stopped.value) or ("", 0)
    assert message.endswith("any repo it had created; nothing was left to resume from; re-run the same command to start again")


def _api() -> Any:
    from huggingface_hub import HfApi

    return HfApi(token="tok_alice")


class Run:
    """The CLI in a subprocess, with its own TMPDIR and HF_HOME under ``root``."""

    def __init__(self, root: Path, *args: str, token: str | None = "tok_alice") -> None:
        self.tmp, self.hf_home = root / "tmp", root / "hf_home"
        self.tmp.mkdir(parents=True)
        env = {**os.environ, "TMPDIR": str(self.tmp), "HF_HOME": str(self.hf_home),
               "HF_AO_PUBLISH_RETRIES": "2", "HF_AO_PUBLISH_RETRY_DELAY": "0.05",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        env.pop("HF_TOKEN", None)
        env.pop("HF_AO_PUBLISH_CACHE", None)  # the resume cache where users have it: under this run's HF_HOME
        if token:
            env["HF_TOKEN"] = token
        self.err_path = root / "stderr.txt"
        self.err = open(self.err_path, "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "publisher.cli", *args], env=env,
                                     stdout=subprocess.DEVNULL, stderr=self.err)

    def wait_for(self, what: str, ready: Callable[[], Any], timeout: float = 300) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := ready()):
            assert self.proc.poll() is None, f"the CLI ended before {what}:\n{self.err_path.read_text()}"
            assert time.monotonic() < deadline, f"never reached {what}:\n{self.err_path.read_text()}"
            time.sleep(0.05)
        return found

    def stop(self, signum: int) -> tuple[int, str]:
        self.proc.send_signal(signum)
        try:
            rc = self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.err.close()
        return rc, self.err_path.read_text()

    def workers(self) -> list[Any]:
        """The CLI's load-path workers: fresh interpreters running loadpath.py, or children forked from the zygote of
        the libraries, itself a branch of the CLI's torch zygote (publisher/runtime/zygote.py); all three keep the
        zygote's command line."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
            return [p for p in kids if any("loadpath.py" in part for part in p.cmdline())
                    or (_is_zygote(p) and _is_zygote(p.parent()) and _is_zygote(p.parent().parent()))]
        except psutil.Error:
            return []

    def zygotes(self) -> list[Any]:
        import psutil

        try:
            return [p for p in psutil.Process(self.proc.pid).children() if _is_zygote(p)]
        except psutil.Error:
            return []


def _is_zygote(proc: Any) -> bool:
    return proc is not None and any(part.endswith("zygote.py") for part in proc.cmdline())


def _the_line(stderr: str, signame: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"Error: interrupted by {signame}: stopped the worker processes, removed this run's "
                               "temporary and unfinished files and any repo it had created; left: "), lines[0]
    assert lines[0].endswith("; re-run the same command to resume"), lines[0]
    return lines[0]


def _gone(pid: int, pgid: int) -> None:
    assert ended(pid)
    # no process at all is left in the worker's group; a member the kill reached counts until it is reaped, which on a
    # loaded machine can come a moment after the CLI has exited, so the group gets 5 s to empty
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def _cache_entries(run: Run) -> list[Path]:
    root = run.hf_home / "hf-ao-publish" / "components"
    return [p for p in root.iterdir() if (p / "hf-ao-publish-cache.json").is_file()] if root.exists() else []


@pytest.mark.slow
def test_sigterm_during_verification_kills_the_workers_and_leaves_the_resume_cache(hub: Any, tiny_llama_dir: Path,
                                                                                    tmp_path: Path) -> None:
    seed("meta/sig-verify", tiny_llama_dir, "tok_meta")
    target = "alice/sig-verify"
    run = Run(tmp_path, "meta/sig-verify", "--quant", "int8wo", "--repo-id", target, *SKIP_EVAL_AND_MATRIX)
    worker = run.wait_for("a verify worker", run.workers)[0]
    zygotes = run.zygotes()  # the torch zygote, and its branch that imported the libraries: forked, as on every Linux run
    assert len(zygotes) == 1 and worker.parent().parent().pid == zygotes[0].pid
    zygotes.append(worker.parent())
    # each worker leads its own process group: the forked child makes it first thing (runtime/zygote.py), which a
    # warm zygote's child may not have done yet when it is first seen here
    deadline = time.monotonic() + 5
    while os.getpgid(worker.pid) != worker.pid and time.monotonic() < deadline:
        time.sleep(0.01)
    pgid = os.getpgid(worker.pid)
    assert pgid == worker.pid != os.getpgid(run.proc.pid)
    assert any(p.name.startswith("hf-ao-verify-") for p in run.tmp.iterdir())
    rc, stderr = run.stop(signal.SIGTERM)
    assert rc == 143, stderr
    line = _the_line(stderr, "SIGTERM")
    assert "the base files downloaded so far, in the Hugging Face cache" in line
    assert f"the quantized model in the resume cache ({run.hf_home / 'hf-ao-publish' / 'components'})" in line
    _gone(worker.pid, pgid)
    for z in zygotes:  # the zygotes the worker was forked from end with the CLI
        _gone(z.pid, z.pid)
    assert list(run.tmp.iterdir()) == []  # hf-ao-verify-*, the hf-ao-publish-* output folder: all removed
    assert not _api().repo_exists(target)
    assert len(_cache_entries(run)) == 1  # what the line promised: a re-run reuses it


@pytest.mark.slow
def test_sigint_during_low_disk_quantization_deletes_the_repo_it_created(hub: Any, tiny_llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    sha = seed("meta/sig-quant", tiny_llama_dir, "tok_meta")
    target = "alice/sig-quant"
    # every range read of the base weights waits: the run sits in its quantization stage
    hub.set_fault(delay_s=1.0, match=f"/meta/sig-quant/resolve/{sha}/model.safetensors", count=10_000)
    run = Run(tmp_path, "meta/sig-quant", "--quant", "int8wo", "--low-disk", "--repo-id", target, *SKIP_EVAL_AND_MATRIX)
    # the plan stage reads the shard headers first (also delayed); --low-disk then makes the target, to upload
    # each shard as it is written, and only then reads the weights
    run.wait_for("the target repo", lambda: _api().repo_exists(target))
    run.wait_for("a range read of the weights", lambda: hub.requests_delayed_now > 0)
    rc, stderr = run.stop(signal.SIGINT)
    assert rc == 130, stderr
    line = _the_line(stderr, "SIGINT")
    assert "resume cache" not in line  # nothing was finished: under --low-disk each shard leaves the disk
    assert not _api().repo_exists(target)
    assert list(run.tmp.iterdir()) == []


@pytest.mark.slow
def test_sigterm_during_download_leaves_no_partial_file(hub: Any, tiny_llama_dir: Path, tmp_path: Path) -> None:
    sha = seed("meta/sig-download", tiny_llama_dir, "tok_meta")
    hub.set_fault(delay_s=1.0, match=f"/meta/sig-download/resolve/{sha}/model.safetensors", count=10_000)
    out = tmp_path / "out"
    run = Run(tmp_path, "meta/sig-download", "--quant", "int8wo", "--no-push", "--output-dir", str(out), *SKIP_EVAL_AND_MATRIX,
              token=None)
    # the plan stage reads the shard headers first (also delayed): wait for the fetch stage, then for its request to
    # be held (a count of fired delays read after the fetch stage began can miss the one request it makes)
    run.wait_for("the fetch stage", lambda: "downloading " in run.err_path.read_text())
    run.wait_for("the weights download", lambda: hub.requests_delayed_now > 0)
    rc, stderr = run.stop(signal.SIGTERM)
    assert rc == 143, stderr
    assert "left: the base files downloaded so far" in _the_line(stderr, "SIGTERM")
    assert list(run.tmp.iterdir()) == [] and not out.exists()
    assert not list(run.hf_home.rglob("*.incomplete"))


@pytest.mark.slow
def test_sigterm_during_the_push_deletes_the_new_repo(hub: Any, tiny_llama_dir: Path, tmp_path: Path) -> None:
    seed("meta/sig-push", tiny_llama_dir, "tok_meta")
    target = "alice/sig-push"
    hub.set_fault(delay_s=1.0, match=f"/api/models/{target}/preupload/", count=10_000)
    # verified in process (the load paths are not this test's subject; the verification test above runs the workers)
    run = Run(tmp_path, "meta/sig-push", "--quant", "int8wo", "--repo-id", target, *IN_PROCESS, *SKIP_EVAL_AND_MATRIX)
    run.wait_for("the upload", lambda: hub.requests_delayed_now > 0)
    assert _api().repo_exists(target)  # created for the commit
    rc, stderr = run.stop(signal.SIGTERM)
    assert rc == 143, stderr
    assert "the quantized model in the resume cache" in _the_line(stderr, "SIGTERM")
    assert not _api().repo_exists(target)
    assert list(run.tmp.iterdir()) == []


@pytest.mark.slow
def test_sigterm_during_the_quality_grid_ends_the_run_within_seconds(hub: Any, tiny_flux_dir: Path, tmp_path: Path) -> None:
    """The evaluation stops like every other stage (issue 38): a SIGTERM while the grid runs (it says so as it goes)
    ends the run within 10 s, with the one line and nothing half-written."""
    out = tmp_path / "out"
    run = Run(tmp_path, str(tiny_flux_dir), "--quant", "int8wo", "--no-push", "--output-dir", str(out), "--compat", "none",
              "--eval-budget", "10m", *IN_PROCESS)
    run.wait_for("the grid's first line", lambda: "grid: timed the base pipeline" in run.err_path.read_text())
    started = time.monotonic()
    rc, stderr = run.stop(signal.SIGTERM)
    assert rc == 143 and time.monotonic() - started < 10, stderr
    _the_line(stderr, "SIGTERM")
    assert not out.exists() or not any(out.iterdir())  # no folder that passes for a repo
    assert list(run.tmp.iterdir()) == []
