"""Progress bars (publisher/runtime/progress.py): drawn only when stderr is a terminal, never with --quiet; the
libraries' bars follow the same decision. The CLI's own output in a CI log (a pipe) is checked end to end by
tests/test_job.py (a push in both transfer modes) and tests/test_cli.py (a publish without a push)."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import termios
from typing import Any

import pytest
from helpers import PROGRESS_VARS

from publisher.runtime import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("quiet", "stream", "shown"), [
    (False, _Terminal(), True),
    (True, _Terminal(), False),  # --quiet: not even on a terminal
    (False, io.StringIO(), False),  # a pipe or a file: a CI log
    (True, io.StringIO(), False),
    (False, object(), False),  # a stream without isatty
])
def test_bars_only_on_a_terminal_and_never_with_quiet(quiet: bool, stream: Any, shown: bool) -> None:
    assert progress.wanted(quiet, stream) is shown


def test_bars_off_are_off_for_the_processes_a_run_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROGRESS_VARS:
        monkeypatch.delenv(name, raising=False)
    assert progress.setup(quiet=False, stream=_Terminal()) is True and progress.shown()
    assert not any(name in os.environ for name in PROGRESS_VARS)  # a terminal: the user's settings, untouched
    assert progress.setup(quiet=False, stream=io.StringIO()) is False and not progress.shown()
    assert {name: os.environ.get(name) for name in PROGRESS_VARS} == {"HF_HUB_DISABLE_PROGRESS_BARS": "1",
                                                                      "TQDM_DISABLE": "1"}


# The libraries' own bar factories, imported after setup as a stage imports them: huggingface_hub's (its downloads and
# uploads, hf_xet's), transformers' ("Loading weights", "Writing model shards") and diffusers' (pipeline loading).
_CHILD = """
import sys
from publisher.runtime import progress

print(progress.setup(quiet="--quiet" in sys.argv))
from huggingface_hub.utils import tqdm as hub_tqdm
from transformers.utils.logging import tqdm as transformers_tqdm
from diffusers.utils.logging import tqdm as diffusers_tqdm

for name, bar in (("hub", hub_tqdm), ("transformers", transformers_tqdm), ("diffusers", diffusers_tqdm)):
    for _ in bar(range(3), desc=f"bar-{name}", mininterval=0):
        pass
"""


def _run(stderr_on_a_terminal: bool) -> tuple[str, str]:
    """(stdout, stderr) of the child, its stderr a pseudo-terminal or a pipe; the suite's own progress settings gone."""
    env = {k: v for k, v in os.environ.items() if k not in PROGRESS_VARS}
    if not stderr_on_a_terminal:
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr
    main, child = pty.openpty()
    termios.tcsetwinsize(child, (24, 100))  # a new pseudo-terminal is 0 columns wide: tqdm would draw an empty bar
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, stderr=child, text=True,
                              timeout=300)
        os.close(child)
        child = -1
        seen = b""
        while True:  # what the child wrote is still there after it ended; then the read fails (EIO) or ends
            try:
                chunk = os.read(main, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    assert proc.returncode == 0, seen.decode(errors="replace")
    return proc.stdout, seen.decode(errors="replace")


@pytest.mark.slow  # two interpreters importing torch (diffusers does)
def test_the_libraries_bars_follow_the_decision() -> None:
    out, err = _run(stderr_on_a_terminal=False)
    assert out == "False\n"
    assert err == ""  # a CI log: not one bar, not one escape code
    out, err = _run(stderr_on_a_terminal=True)
    assert out == "True\n"
    assert all(f"bar-{name}: 100%" in err for name in ("hub", "transformers", "diffusers")), err
