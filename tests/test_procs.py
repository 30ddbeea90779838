"""Child processes run in their own process group and are killed with it when we stop waiting (publisher/runtime/procs.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_ended


def test_a_timeout_kills_the_whole_group_and_a_normal_run_returns_its_output(tmp_path: Path) -> None:
    from publisher.runtime import procs

    pid_file = tmp_path / "grandchild.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run([sys.executable, "-c", script], timeout=3)
    assert time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    assert wait_ended(grandchild, 10)  # the child's own child died with the group
    done = procs.run([sys.executable, "-c", "import os, sys; print(os.getpgid(0) == os.getpid()); sys.exit(3)"])
    assert done.returncode == 3 and done.stdout.strip() == "True"  # it led a process group of its own
