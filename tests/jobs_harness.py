"""What the Hugging Face Jobs tests share: a job's own --json result read from its log, and the CLI run as a
subprocess that gets Ctrl-C once it follows its jobs.

Not a test module (pytest does not collect it): test_hfjobs_e2e.py and test_hfjobs_many.py import it.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from publisher.hfjobs.follow import RemoteOutcome, decode_result, take_marker

ROOT = Path(__file__).resolve().parent.parent


def result_in_log(hub: Any, job_id: str) -> dict[str, Any] | None:
    """What the job itself wrote to its log as its --json result (decoded here independently of the CLI)."""
    outcome = RemoteOutcome("", "", job_id, "", "")
    for _, line in hub.jobs.get(job_id).log:
        take_marker(outcome, line)
    return decode_result(outcome)


def interrupted_while_following(args: list[str], token: str, jobs: int, wait_s: float,
                                before: Callable[[str], None] = lambda seen: None) -> tuple[str, str, int | None]:
    """`python -m publisher.cli ARGS` with HF_TOKEN set, SIGINT once it says it follows ``jobs`` job(s) (after
    ``before(what it printed so far)``); returns (stderr up to then, stderr after, exit code within ``wait_s``)."""
    env = {**os.environ, "HF_TOKEN": token,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "publisher.cli", *args], stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr
    threading.Thread(target=lambda: [lines.put(line) for line in stderr], daemon=True).start()
    marker = f"following {jobs} job(s)"
    try:
        seen = ""
        deadline = time.monotonic() + 300
        while marker not in seen and time.monotonic() < deadline and proc.poll() is None:
            try:
                seen += lines.get(timeout=1)
            except queue.Empty:
                continue
        assert marker in seen, seen
        before(seen)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=wait_s)
        time.sleep(0.5)  # the reader thread drains what is left
        rest = "".join(iter(lambda: lines.get_nowait() if not lines.empty() else "", ""))
    finally:
        if proc.poll() is None:
            proc.kill()
    return seen, rest, code
