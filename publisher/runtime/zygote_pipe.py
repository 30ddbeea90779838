"""The caller's end of a publisher/runtime/zygote.py process: a zygote (publisher/runtime/zygotes.py) or a single-use
interpreter started ahead (``--once``, publisher/runtime/prestarted.py).

The process runs in a session of its own (a terminal's Ctrl-C does not reach it behind our back; a kill takes its
group whole), gets no stderr of ours (what its imports print is replayed to each script's own files), and answers on
its stdout, one JSON object a line, which ``line`` reads with a deadline: a process that is still importing, or has
hung, never blocks the caller past it.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from publisher.runtime import procs, zygote

SERVER = Path(zygote.__file__).resolve()
READY_TIMEOUT_S = 600  # importing torch from a cold disk on a slow machine


class Gone(Exception):
    """The process ended or said something else than the protocol's next line."""


class Unimportable(Gone):
    """The process could not import ``module``, one of its list: it is not ready, and never will be with that list."""

    def __init__(self, module: str) -> None:
        super().__init__(f"cannot import {module}")
        self.module = module


class Server:
    """One zygote.py process: ``python zygote.py [--once] MODULE...`` in ``env``."""

    def __init__(self, python: str, env: Mapping[str, str], preload: Sequence[str], *, once: bool = False) -> None:
        self.proc = subprocess.Popen([python, str(SERVER), *(["--once"] if once else []), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=dict(env), start_new_session=True)
        self._buf = b""

    def send(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, outputs: tuple[Path, Path]) -> None:
        """The request to run ``argv`` (script and arguments) in ``cwd`` with ``env``, stdout and stderr to
        ``outputs``. Raises ``Gone`` if the process has gone (its stdin closed)."""
        req = {"argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": str(outputs[0]), "stderr": str(outputs[1])}
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(req).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise Gone(str(exc)) from exc

    def ready(self) -> None:
        """Wait for the ready line (the imports made); ``Unimportable`` if an import failed, ``Gone`` if it says
        otherwise or ends, ``TimeoutExpired`` after READY_TIMEOUT_S."""
        said = self.line(time.monotonic() + READY_TIMEOUT_S)
        if said != {"ready": True}:
            raise Unimportable(said["unimportable"]) if isinstance(said.get("unimportable"), str) else Gone("not ready")

    def line(self, deadline: float | None) -> dict[str, Any]:
        """The next answer; ``subprocess.TimeoutExpired`` at ``deadline`` (``time.monotonic``), ``Gone`` when the
        process ended or said something that is not a JSON object."""
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

    def close(self, grace: float = 5) -> None:
        """Close its stdin (it ends when idle), give it ``grace`` seconds to end, then kill its group; reaped."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            procs.kill_group(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
