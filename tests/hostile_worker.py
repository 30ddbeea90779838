"""Runs the hostile-input cases of tests/test_hostile_input.py one after another in this one process.

One process for all cases keeps the suite fast (torch & co are imported once) and still measures memory per
case: the kernel's peak-RSS mark of this process (``VmHWM`` in /proc/self/status) is reset before each case
(writing 5 to /proc/self/clear_refs) and read after it. Where the reset is not allowed, the mark is this process's
peak so far, so "below the bound after every case" still proves that no case went over it. (``ru_maxrss`` would
not do: it keeps the peak of the forking parent, pytest, from before the exec.) Each case runs the real CLI in-process through
``CliRunner(catch_exceptions=False)``, with its own HOME, TMPDIR and working folder, which must stay empty, and
an alarm that turns a hang (e.g. a FIFO opened for reading) into a failure.

Usage: python tests/hostile_worker.py PLAN.json RESULTS.json  (HF_ENDPOINT and HF_HOME set by the caller)
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any


def _public_repos() -> set[tuple[str, str]]:
    from huggingface_hub import HfApi

    return {(m.id, m.sha or "") for m in HfApi().list_models()}


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: an upper bound


def _hang(signum: int, frame: Any) -> None:
    raise TimeoutError("the case did not finish within its time limit (hung?)")


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    from click.testing import CliRunner

    from publisher.cli import main

    root = Path(case["sandbox"])
    dirs = {name: root / name for name in ("home", "tmp", "cwd")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"], os.environ["TMPDIR"] = str(dirs["home"]), str(dirs["tmp"])
    tempfile.tempdir = None  # re-read TMPDIR
    if case["token"]:
        os.environ["HF_TOKEN"] = case["token"]
    else:
        os.environ.pop("HF_TOKEN", None)
    os.chdir(dirs["cwd"])
    before = _public_repos()
    reset = _reset_peak()
    started = time.monotonic()
    signal.alarm(case["timeout"])
    try:
        result = CliRunner().invoke(main, case["args"], catch_exceptions=False)
        code, stdout, stderr = result.exit_code, result.stdout, result.stderr
    except BaseException:  # a traceback escaped the CLI: recorded, the test fails on it
        code, stdout, stderr = None, "", traceback.format_exc()
    finally:
        signal.alarm(0)
    return {
        "code": code, "stdout": stdout, "stderr": stderr, "seconds": round(time.monotonic() - started, 2),
        "peak_rss": _peak_rss(), "peak_reset": reset,
        "repos_changed": sorted(map(list, _public_repos() ^ before)),
        "written": {name: sorted(str(p.relative_to(d)) for p in d.rglob("*")) for name, d in dirs.items()},
    }


def main(plan_file: str, result_file: str) -> None:
    signal.signal(signal.SIGALRM, _hang)
    results = {}
    for case in json.loads(Path(plan_file).read_text()):
        results[case["id"]] = run_case(case)
        Path(result_file).write_text(json.dumps(results))  # kept after each case: a crash still reports the rest


if __name__ == "__main__":
    main(*sys.argv[1:])
