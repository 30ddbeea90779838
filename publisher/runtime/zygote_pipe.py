"""The caller's end of a publisher/runtime/zygote.py process: a zygote (publisher/runtime/zygotes.py), a single-use
interpreter started ahead (``--once``, publisher/runtime/prestarted.py), or a zygote of a layered environment forked
from this interpreter's torch zygote (``Branch``).

The process runs in a session of its own (a terminal's Ctrl-C does not reach it behind our back; a kill takes its
group whole), gets no stderr of ours (what its imports print is replayed to each script's own files), and answers on
its stdout (a branch: on its connection), one JSON object a line, which ``line`` reads with a deadline: a process that
is still importing, or has hung, never blocks the caller past it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
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


class NotReady(Gone):
    """The process said it is not ready: its imports failed or left it unable to serve (CUDA initialized)."""


class NotALayer(Gone):
    """A branch refused: the interpreter is no layer over this one's (zygote.py ``_enter_layer`` says why)."""


class Channel:
    """The protocol's caller end: requests written, answers read a line at a time with a deadline."""

    def __init__(self) -> None:
        self._buf = b""

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _answers(self) -> int:  # the file descriptor the answers come on
        raise NotImplementedError

    def ended(self) -> bool:
        raise NotImplementedError

    def close(self, grace: float = 5) -> None:
        raise NotImplementedError

    def request(self, req: dict[str, Any]) -> None:
        """Send one request; ``Gone`` if the process has gone (its end closed)."""
        try:
            self._write(json.dumps(req).encode() + b"\n")
        except OSError as exc:
            raise Gone(str(exc)) from exc

    def send(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, outputs: tuple[Path, Path]) -> None:
        """The request to run ``argv`` (script and arguments) in ``cwd`` with ``env``, stdout and stderr to
        ``outputs``. Raises ``Gone`` if the process has gone (its stdin closed)."""
        self.request({"argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": str(outputs[0]),
                      "stderr": str(outputs[1])})

    def ready(self) -> None:
        """Wait for the ready line (the imports made); ``Unimportable`` if an import failed, ``NotALayer`` if a branch
        refused, ``Gone`` if it says otherwise or ends, ``TimeoutExpired`` after READY_TIMEOUT_S."""
        said = self.line(time.monotonic() + READY_TIMEOUT_S)
        if said != {"ready": True}:
            if isinstance(said.get("unimportable"), str):
                raise Unimportable(said["unimportable"])
            raise NotALayer(str(said["not_a_layer"])) if "not_a_layer" in said else NotReady("not ready")

    def line(self, deadline: float | None) -> dict[str, Any]:
        """The next answer; ``subprocess.TimeoutExpired`` at ``deadline`` (``time.monotonic``), ``Gone`` when the
        process ended or said something that is not a JSON object."""
        fd = self._answers()
        while b"\n" not in self._buf:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise subprocess.TimeoutExpired("zygote", 0)
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


class Server(Channel):
    """One zygote.py process: ``python zygote.py [--once] MODULE...`` in ``env``."""

    def __init__(self, python: str, env: Mapping[str, str], preload: Sequence[str], *, once: bool = False) -> None:
        super().__init__()
        self.proc = subprocess.Popen([python, str(SERVER), *(["--once"] if once else []), *preload],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=dict(env), start_new_session=True)

    def _write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _answers(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def ended(self) -> bool:
        return self.proc.poll() is not None

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


class Branch(Channel):
    """A zygote of the layered environment ``python``, forked from ``parent`` (a zygote of this interpreter that
    imported torch: zygote.py's ``branch`` request): it answers on a Unix socket connection of its own. Not our child
    (the parent's), so it is watched through that connection and killed by its process group."""

    def __init__(self, parent: Channel, python: str, env: Mapping[str, str], preload: Sequence[str]) -> None:
        super().__init__()
        folder = tempfile.mkdtemp(prefix="hf-ao-branch-")  # only we can reach a socket in it (mode 0700)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(os.path.join(folder, "s"))
            listener.listen(1)
            listener.settimeout(60)  # the branch connects before anything else it does
            parent.request({"branch": {"python": python, "preload": list(preload), "env": dict(env),
                                       "socket": os.path.join(folder, "s")}})
            self.pid = int(parent.line(time.monotonic() + 60)["pid"])
            try:
                self.conn, _ = listener.accept()
            except OSError as exc:  # socket.timeout included
                self._kill()
                raise Gone(f"the branch did not connect ({exc})") from exc
        finally:
            listener.close()
            shutil.rmtree(folder, ignore_errors=True)
        self.conn.setblocking(True)
        self._closed = False

    def _write(self, data: bytes) -> None:
        self.conn.sendall(data)

    def _answers(self) -> int:
        return self.conn.fileno()

    def ended(self) -> bool:
        """Whether its end of the connection closed (it ended); answers not yet read are left for ``line``."""
        if self._closed:
            return True
        if not select.select([self.conn], [], [], 0)[0]:
            return False
        return self.conn.recv(1, socket.MSG_PEEK) == b""

    def close(self, grace: float = 5) -> None:
        """Close the connection (it ends when idle), give it ``grace`` seconds to end, then kill its group."""
        if self._closed:
            return
        self._closed = True
        try:
            self.conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + grace
            while (wait := deadline - time.monotonic()) > 0 and select.select([self.conn], [], [], wait)[0]:
                if not self.conn.recv(4096):
                    break  # it closed its end: it has ended
            else:
                self._kill()
        except OSError:
            self._kill()
        finally:
            self.conn.close()

    def _kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
