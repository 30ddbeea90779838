"""Python scripts run in children forked from a zygote of their interpreter, or in a fresh interpreter.

A verify worker is a fresh interpreter by design (publisher/verify/workers.py), and some 3 s of its 5 s go to
importing torch (publisher/runtime/zygote.py says what the zygote imports and why nothing more). ``run()`` forks
the script from a zygote that has done that import once: a publish that verifies two load paths imports torch
once instead of twice, and a process that publishes many times (several recipes, the compatibility matrix, a
test session) imports it once per interpreter. The child is what ``python SCRIPT ARG...`` would be, with torch
already imported: the caller's environment, working directory and arguments, its own process group, stdout and
stderr in files that are read back.

A zygote serves one interpreter and one environment: it is reused only while every variable outside the Hugging
Face libraries' own (``HF_*``, ``HUGGINGFACE_*``, ``TRANSFORMERS_*``, ``DIFFUSERS_*``, which nothing the zygote
imports reads) is what it was when the zygote started; at most ``MAX_ZYGOTES`` live at once (the least recently
used is closed). Where there is no zygote the script runs in a fresh interpreter, as before: not on Linux (fork
after torch's import is what PyTorch's own data loaders do on Linux; macOS's system libraries refuse it), with
``HF_AO_PUBLISH_ZYGOTE=0``, for a caller that asks so (a load on a GPU: CUDA cannot be used across a fork, so it
is initialized in the new process only), or when the interpreter cannot run one (a stand-in script, an interpreter
that exits, torch's import having initialized CUDA).
Zygotes end with the process (and on their own when it is gone: their stdin closes).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from publisher.runtime import procs, zygote

log = logging.getLogger(__name__)

SERVER = Path(zygote.__file__).resolve()
SWITCH = "HF_AO_PUBLISH_ZYGOTE"
MAX_ZYGOTES = 2
READY_TIMEOUT_S = 600  # importing torch from a cold disk on a slow machine
LIBRARY_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "DIFFUSERS_")
UNREAD = ("PYTEST_CURRENT_TEST",)  # changes with every test, read by nothing the zygote imports


class Gone(Exception):
    """The zygote ended or said something else than the protocol's next line."""


class Zygote:
    """One zygote process (publisher/runtime/zygote.py run by ``python``), serving one script at a time."""

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        self.proc = subprocess.Popen([python, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=dict(env), start_new_session=True)
        self._buf = b""
        self.lock = threading.Lock()
        try:
            if self._line(time.monotonic() + READY_TIMEOUT_S) != {"ready": True}:
                raise Gone("not a zygote")
        except BaseException:
            self.close()
            raise

    def run(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, outputs: tuple[Path, Path],
            timeout: float | None) -> int:
        """Fork a child that runs ``argv`` (script and arguments) in ``cwd``, its stdout and stderr to ``outputs``;
        its exit code. Raises ``subprocess.TimeoutExpired`` after killing it, ``Gone`` if the zygote went away."""
        req = {"argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": str(outputs[0]), "stderr": str(outputs[1])}
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise Gone(str(exc)) from exc
        pid = int(self._line(time.monotonic() + READY_TIMEOUT_S)["pid"])
        deadline = time.monotonic() + timeout if timeout is not None else None
        try:
            return int(self._line(deadline)["exit"])
        except subprocess.TimeoutExpired:
            _kill_group(pid)
            try:
                self._line(time.monotonic() + 60)  # the killed child's exit: the zygote serves on
            except BaseException:
                self.close()
                raise
            raise
        except BaseException:  # SIGINT/SIGTERM (errors.Interrupted), the zygote gone: the child goes too
            _kill_group(pid)
            self.close()
            raise

    def _line(self, deadline: float | None) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise subprocess.TimeoutExpired(self.proc.args, 0)
            if not select.select([fd], [], [], wait)[0]:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                raise Gone("ended")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise Gone(f"said {line[:100]!r}") from exc
        if not isinstance(data, dict):
            raise Gone(f"said {line[:100]!r}")
        return data

    def close(self) -> None:
        """Close its stdin (it ends when idle) and make sure it has ended."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            procs.kill_group(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_zygotes: OrderedDict[tuple[str, frozenset[tuple[str, str]]], Zygote] = OrderedDict()
_without: set[tuple[str, frozenset[tuple[str, str]]]] = set()  # interpreters that could not run one
_lock = threading.Lock()


def run(python: str, script: Path, args: Sequence[str], *, env: Mapping[str, str], timeout: float | None,
        outputs: Path, forked: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python script args...`` with ``env`` in ``cwd`` (default: ours), like ``procs.run`` (stdout and stderr in
    the result; a timeout raises ``subprocess.TimeoutExpired`` after the kill), forked from a zygote where there is
    one and ``forked``. A forked child writes its stdout and stderr to ``outputs`` + ``.stdout`` / ``.stderr``, which
    are read back."""
    argv = [str(script), *args]
    z = _zygote(python, env) if forked else None
    if z is not None:
        files = (outputs.with_name(outputs.name + ".stdout"), outputs.with_name(outputs.name + ".stderr"))
        with z.lock:
            try:
                code = z.run(argv, env, str(cwd or os.getcwd()), files, timeout)
            except Gone as exc:
                log.debug("the zygote of %s went away (%s); a fresh interpreter instead", python, exc)
                _forget(z)
            else:
                return subprocess.CompletedProcess([python, *argv], code, _read(files[0]), _read(files[1]))
            finally:
                if z.proc.poll() is not None:
                    _forget(z)
    return procs.run([python, *argv], env=env, timeout=timeout, cwd=cwd)


def _zygote(python: str, env: Mapping[str, str]) -> Zygote | None:
    if sys.platform != "linux" or env.get(SWITCH) == "0":
        return None
    key = (python, frozenset((k, v) for k, v in env.items() if not k.startswith(LIBRARY_PREFIXES) and k not in UNREAD))
    with _lock:
        if key in _without:
            return None
        if key in _zygotes:
            _zygotes.move_to_end(key)
            return _zygotes[key]
        try:  # the zygote gets none of the libraries' variables (no token): its children get the caller's
            z = Zygote(python, dict(key[1]))
        except (OSError, Gone, subprocess.TimeoutExpired) as exc:
            log.debug("no zygote for %s (%s): fresh interpreters", python, exc)
            _without.add(key)
            return None
        _zygotes[key] = z
        while len(_zygotes) > MAX_ZYGOTES:
            _zygotes.popitem(last=False)[1].close()
        return z


def _forget(z: Zygote) -> None:
    with _lock:
        for key, value in list(_zygotes.items()):
            if value is z:
                del _zygotes[key]
    z.close()


@atexit.register
def close_all() -> None:
    with _lock:
        while _zygotes:
            _zygotes.popitem()[1].close()


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group (it makes one, its pid the group's, a moment after the fork; before that,
    the child alone)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            continue


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
