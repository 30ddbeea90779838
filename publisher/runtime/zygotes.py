"""Python scripts run in children forked from a zygote of their interpreter, or in a fresh interpreter.

A verify worker is a fresh interpreter by design (publisher/verify/workers.py), and most of its time goes to
imports: torch (some 3 s of a worker's 5 s on a 2-core machine), then the library and torchao (1 to 2 s).
``run()`` forks the script from a zygote that has made those imports once (publisher/runtime/zygote.py): a
process that verifies several load paths, recipes or environments (a test session too) makes them once per
interpreter. The child is what ``python SCRIPT ARG...`` would be after those imports: the caller's environment,
working directory and arguments, its own process group, stdout and stderr in files that are read back.

What a zygote imports is the caller's choice, and only what the script would import first anyway: ``TORCH`` for
any script (a card snippet's first line is ``import torch``), ``LIBRARIES`` for a load path (what every load path
imports before it reads a checkpoint: transformers' and diffusers' model base classes, with whatever those import
in the interpreter's versions). A zygote serves one interpreter, one such list and one environment: it is reused
only while every variable its imports could read is what it was when it started (``NOT_READ_BY_TORCH`` and
``NOT_READ_BY_LIBRARIES`` list those that may differ: the token, our own, ...); at most ``max_zygotes()`` live at
once (the least recently used is closed: 8, or fewer where memory is short). Where there is no zygote the script runs in a fresh interpreter: not on
Linux (fork after torch's import is what PyTorch's own data loaders do on Linux; macOS's system libraries refuse
it), with ``HF_AO_PUBLISH_ZYGOTE=0``, for a caller that asks so (a load on a GPU: CUDA cannot be used across a
fork, so it is initialized in the new process only), or when the interpreter cannot run one (a stand-in script, an
interpreter that exits, an import that fails, torch's import having initialized CUDA). Zygotes end with the
process (and on their own when it is gone: their stdin closes).
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
ZYGOTE_BYTES = 360 * 1024 * 1024  # one that imported torch and the libraries' base classes (measured: 353 MB unique)
READY_TIMEOUT_S = 600  # importing torch from a cold disk on a slow machine
TORCH = tuple(zygote.PRELOAD)  # torch and torch._dynamo: the first import of every script we run
# ... and what every load path imports before it reads a checkpoint: the libraries' model base classes (in the versions
# we run, transformers' imports torchao); a script that loads no model never gets these
LIBRARIES = (*TORCH, "transformers.modeling_utils", "diffusers.models.modeling_utils")
# Variables a zygote's imports do not read. Torch reads none of the Hugging Face libraries' (or ours); the libraries
# read theirs at import (huggingface_hub its endpoint and folders, ...) but the token only when a call needs it, and
# none reads ours. PYTEST_CURRENT_TEST changes with every test and is read by none.
NOT_READ_BY_TORCH = ("HF_", "HUGGINGFACE_", "HUGGING_FACE_", "TRANSFORMERS_", "DIFFUSERS_", "PYTEST_CURRENT_TEST")
NOT_READ_BY_LIBRARIES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_AO_PUBLISH_", "PYTEST_CURRENT_TEST")


class Gone(Exception):
    """The zygote ended or said something else than the protocol's next line."""


class Zygote:
    """One zygote process (publisher/runtime/zygote.py run by ``python``), serving one script at a time."""

    def __init__(self, python: str, env: Mapping[str, str], preload: Sequence[str]) -> None:
        self.proc = subprocess.Popen([python, str(SERVER), *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
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


_Key = tuple[str, tuple[str, ...], frozenset[tuple[str, str]]]
_zygotes: OrderedDict[_Key, Zygote] = OrderedDict()
_without: set[_Key] = set()  # interpreters that could not run one
_early: dict[tuple[str, tuple[str, ...]], _Key] = {}  # (python, preload) -> the key a start() made a zygote for
_lock = threading.Lock()


def start(python: str, env: Mapping[str, str], preload: tuple[str, ...] = TORCH) -> None:
    """Start, on a thread of its own, the zygote that a later ``run`` with these arguments forks from, so its imports
    overlap what the caller does meanwhile (the verification's, the quantization: issue 41). Returns at once; a
    ``run`` that comes before it is ready waits for it (sooner than a fresh one), and one whose environment differs by
    then starts its own (said at debug level)."""
    if sys.platform != "linux" or env.get(SWITCH) == "0":
        return
    key = _key(python, env, preload)
    with _lock:
        if key in _zygotes or key in _without:
            return
        _early[python, preload] = key
    # a daemon thread: a process that ends before the zygote is ready does not wait for it (atexit closes it)
    threading.Thread(target=_zygote, args=(python, dict(env), preload), name="zygote-start", daemon=True).start()


def run(python: str, script: Path, args: Sequence[str], *, env: Mapping[str, str], timeout: float | None,
        outputs: Path, forked: bool = True, cwd: Path | None = None,
        preload: tuple[str, ...] = TORCH) -> subprocess.CompletedProcess[str]:
    """``python script args...`` with ``env`` in ``cwd`` (default: ours), like ``procs.run`` (stdout and stderr in
    the result; a timeout raises ``subprocess.TimeoutExpired`` after the kill), forked from a zygote where there is
    one and ``forked``, from one that imported ``preload``. A forked child writes its stdout and stderr to
    ``outputs`` + ``.stdout`` / ``.stderr``, which are read back."""
    argv = [str(script), *args]
    z = _zygote(python, env, preload) if forked else None
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


def _zygote(python: str, env: Mapping[str, str], preload: tuple[str, ...]) -> Zygote | None:
    if sys.platform != "linux" or env.get(SWITCH) == "0":
        return None
    key = _key(python, env, preload)
    with _lock:
        if key in _without:
            return None
        early = _early.get((python, preload))
        if key in _zygotes:
            if early == key:
                log.debug("the zygote of %s started early is used", python)
            _zygotes.move_to_end(key)
            return _zygotes[key]
        if early is not None and early != key:
            changed = sorted({k for k, _ in early[2] ^ key[2]})
            log.debug("the zygote of %s started early is not used: the environment changed since (%s)", python,
                      ", ".join(changed))
        try:  # the zygote gets none of the libraries' variables (no token): its children get the caller's
            z = Zygote(python, dict(key[2]), preload)
        except (OSError, Gone, subprocess.TimeoutExpired) as exc:
            log.debug("no zygote for %s (%s): fresh interpreters", python, exc)
            _without.add(key)
            return None
        _zygotes[key] = z
        while len(_zygotes) > max_zygotes():
            _zygotes.popitem(last=False)[1].close()
        return z


def _key(python: str, env: Mapping[str, str], preload: tuple[str, ...]) -> _Key:
    """What a zygote serves: the interpreter, its imports, and every variable those imports could read."""
    unread = NOT_READ_BY_TORCH if all(m.split(".")[0] == "torch" for m in preload) else NOT_READ_BY_LIBRARIES
    return python, preload, frozenset((k, v) for k, v in env.items() if not k.startswith(unread))


def max_zygotes() -> int:
    """How many zygotes may live at once: enough for this interpreter and every environment of the default
    compatibility matrix (up to 6) and the card snippets' (8), so that a run measuring several recipes, or a process
    running several publishes, starts each once; fewer where they would take more than a sixth of the memory
    available (each holds about ZYGOTE_BYTES), never under 3."""
    import psutil

    return max(3, min(8, int(psutil.virtual_memory().available / 6 // ZYGOTE_BYTES)))


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
