"""Child processes (verify workers, measurements) in their own process group, killed with it when we stop waiting.

``start_new_session=True`` puts the child and anything it starts in a new process group, so a terminal's Ctrl-C
does not reach it behind our back, and a whole tree can be killed at once: if waiting ends in any exception (a
timeout, or SIGINT / SIGTERM turned into ``errors.Interrupted`` by publisher.runtime.signals), the group is sent SIGKILL
and the child reaped before the exception goes on. Nothing we start outlives the run.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def run(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Like ``subprocess.run(cmd, capture_output=True, text=True)``, in a new process group that is killed on any
    exception (``subprocess.TimeoutExpired`` included, re-raised after the kill)."""
    # stdin from /dev/null: a child never reads what was meant for us (a terminal, a pipe we were given)
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None, cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the child's process group (the child leads it: its pgid is its pid), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # before the child is reaped, its pid cannot name another group
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()  # a killed process ends whatever its pipes hold
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
